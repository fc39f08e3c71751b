"""gemmd's Prometheus exporter: collectors per metric group (``collectors``), the cached
/metrics body (``exposition``) and the HTTP server (``http``)."""

from gemmd.exporter.collectors import Metrics, assemble
from gemmd.exporter.exposition import Exposition
from gemmd.exporter.http import WebConfig, load_web_config, serve

__all__ = ["Exposition", "Metrics", "WebConfig", "assemble", "load_web_config", "serve"]
