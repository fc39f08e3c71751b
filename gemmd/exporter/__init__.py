"""gemmd's Prometheus exporter: collectors per metric group (``collectors``), the cached
/metrics body (``exposition``) and the HTTP server (``http``)."""

from gemmd.exporter.collectors import Metrics, assemble, host_name
from gemmd.exporter.exposition import Exposition
from gemmd.exporter.http import serve

__all__ = ["Exposition", "Metrics", "assemble", "host_name", "serve"]
