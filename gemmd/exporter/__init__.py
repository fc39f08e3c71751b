"""gemmd's Prometheus exporter: the series' labels and profiles (``series``), collectors per
metric group (``collectors``) put together by ``assembly``, the cached /metrics body
(``exposition``) and the HTTP server (``http``)."""

from gemmd.exporter.assembly import Metrics, assemble
from gemmd.exporter.exposition import Exposition
from gemmd.exporter.http import serve
from gemmd.exporter.series import host_name

__all__ = ["Exposition", "Metrics", "assemble", "host_name", "serve"]
