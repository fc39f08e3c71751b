"""The HTTP side of the exporter: /metrics (gzip when asked), a landing page."""

from __future__ import annotations

import socket
import threading
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CONTENT_TYPE_LATEST

from gemmd.exporter.exposition import Exposition


def app(exposition: Exposition):
    """The WSGI application serving ``exposition``."""

    def wsgi(environ: dict, start_response) -> list[bytes]:
        path, method = environ.get("PATH_INFO", "/"), environ["REQUEST_METHOD"]
        if method not in ("GET", "HEAD"):
            start_response("405 Method Not Allowed", [("Allow", "GET, HEAD")])
            return [b""]
        if path == "/metrics":
            gz = "gzip" in environ.get("HTTP_ACCEPT_ENCODING", "")
            body = exposition.body(gz)
            headers = [("Content-Type", CONTENT_TYPE_LATEST),
                       ("Content-Length", str(len(body)))]
            if gz:
                headers.append(("Content-Encoding", "gzip"))
            start_response("200 OK", headers)
            return [body if method == "GET" else b""]
        if path == "/":
            body = b"<html><body><h1>gemmd</h1><a href='/metrics'>/metrics</a></body></html>"
            start_response("200 OK", [("Content-Type", "text/html")])
            return [body]
        start_response("404 Not Found", [("Content-Type", "text/plain")])
        return [b"not found; metrics are at /metrics\n"]
    return wsgi


class _Handler(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # no access log on stderr
        pass


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


def serve(exposition: Exposition, address: str, port: int) -> WSGIServer:
    """Serve /metrics on a background thread; IPv6 addresses work too."""
    family = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)[0][0]
    server_cls = type("_Server", (_Server,), {"address_family": family})
    httpd = make_server(address, port, app(exposition), server_cls, handler_class=_Handler)
    threading.Thread(target=httpd.serve_forever, name="gemmd-http", daemon=True).start()
    return httpd
