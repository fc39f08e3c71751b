"""What the exporter answers: the request line checked as soon as it arrives (a bad one
is answered at once, with the status that says why), the WSGI application (/metrics,
gzip when asked, the health endpoints, the runbook, a landing page) and the canned answers
the server writes itself.
"""

from __future__ import annotations

import io
import logging
import re
import sys
from collections.abc import Callable, Iterable
from email.utils import formatdate
from typing import Any
from urllib.parse import unquote_to_bytes
from wsgiref.handlers import SimpleHandler
from wsgiref.headers import Headers

from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.exposition import gzip_accepted

from gemmd.config import WebConfig
from gemmd.exporter.access import BasicAuth
from gemmd.exporter.exposition import Exposition

logger = logging.getLogger("gemmd.exporter.http")

SERVER = "gemmd"  # the Server header: no version numbers for scanners
REALM = 'Basic realm="gemmd"'
HEALTH_PATHS = ("/-/healthy", "/-/ready")
RUNBOOK_PATHS = ("/runbook", "/runbook.md")
PUBLIC_PATHS = (*HEALTH_PATHS, *RUNBOOK_PATHS)  # answered without credentials
TEXT = ("Content-Type", "text/plain; charset=utf-8")


# ------------------------------------------------------------------------- the WSGI app

def gzip_wanted(accept_encoding: str | None) -> bool:
    """Whether Accept-Encoding allows gzip: client_python's ``gzip_accepted`` (gzip named),
    except that ``gzip;q=0`` refuses it (RFC 9110, 12.5.3), which that helper ignores."""
    if not gzip_accepted(accept_encoding or ""):
        return False
    for item in (accept_encoding or "").split(","):
        coding, *params = item.split(";")
        if coding.strip().lower() != "gzip":
            continue
        q = "1"
        for p in params:
            name, _, value = p.partition("=")
            if name.strip().lower() == "q":
                q = value.strip()
        if re.fullmatch(r"(0(\.\d{0,3})?|1(\.0{0,3})?)", q) and float(q) > 0:
            return True
    return False


def app(exposition: Exposition, *, ready: Callable[[], bool] | None = None,
        web_config: WebConfig | None = None, auth: BasicAuth | None = None):
    """The WSGI application serving ``exposition``: /metrics, /, /-/healthy, /-/ready, and
    the runbook (/runbook, /runbook.md). With ``web_config.users``, everything but the
    health endpoints and the runbook needs basic auth
    (``auth``, or one made from them). The server decides on credentials before a request
    reaches the app (``environ["gemmd.auth"]``: "ok" or "refused"); without that verdict
    the app checks them itself."""
    if auth is None and web_config is not None and web_config.users:
        auth = BasicAuth(web_config.users)
    extra = list(web_config.headers) if web_config is not None else []

    def wsgi(environ: dict, start_response) -> list[bytes]:
        path, method = environ.get("PATH_INFO", "/"), environ["REQUEST_METHOD"]

        def respond(status: str, headers: list[tuple[str, str]], body: bytes) -> list[bytes]:
            start_response(status, [*headers, ("Content-Length", str(len(body))), *extra])
            return [b"" if method == "HEAD" else body]

        if method not in ("GET", "HEAD"):
            return respond("405 Method Not Allowed", [("Allow", "GET, HEAD"), TEXT],
                           b"method not allowed; use GET or HEAD\n")
        if path == "/-/healthy":
            return respond("200 OK", [TEXT], b"gemmd is healthy.\n")
        if path == "/-/ready":
            if _is_ready(ready):
                return respond("200 OK", [TEXT], b"gemmd is ready.\n")
            return respond("503 Service Unavailable", [TEXT], b"gemmd is not ready.\n")
        if path in RUNBOOK_PATHS:
            from gemmd.exporter import runbook

            if path == "/runbook":
                return respond("200 OK", [("Content-Type", "text/html; charset=utf-8")],
                               runbook.page())
            return respond("200 OK", [("Content-Type", "text/markdown; charset=utf-8")],
                           runbook.source())
        verdict = environ.get("gemmd.auth")
        if auth is not None and verdict != "ok" and (
                verdict == "refused" or not auth.check(environ.get("HTTP_AUTHORIZATION"))):
            return respond("401 Unauthorized", [("WWW-Authenticate", REALM), TEXT],
                           b"Unauthorized\n")
        if path == "/metrics":
            gz = gzip_wanted(environ.get("HTTP_ACCEPT_ENCODING"))
            body = exposition.body(gz)
            headers = [("Content-Type", CONTENT_TYPE_LATEST), ("Vary", "Accept-Encoding")]
            if gz:
                headers.append(("Content-Encoding", "gzip"))
            return respond("200 OK", headers, body)
        if path == "/":
            return respond("200 OK", [("Content-Type", "text/html; charset=utf-8")],
                           b"<html><head><title>gemmd</title></head><body><h1>gemmd</h1>"
                           b"<p><a href='/metrics'>/metrics</a></p>"
                           b"<p><a href='/runbook'>/runbook</a>: what each alert means and "
                           b"what to do</p></body></html>\n")
        return respond("404 Not Found", [TEXT], b"not found; metrics are at /metrics\n")
    return wsgi


def _is_ready(ready: Callable[[], bool] | None) -> bool:
    if ready is None:
        return True
    try:
        return bool(ready())
    except Exception as e:  # noqa: BLE001 - not ready, whatever the reason
        logger.debug("ready() failed: %s", e)
        return False


class _Gateway(SimpleHandler):
    """wsgiref's WSGI gateway, writing one whole response (status line, Date, Server
    headers, the body) into memory for the event loop to send."""

    server_software = SERVER
    http_version = "1.1"
    os_environ: dict = {}  # not the process environment in every request
    # Set by BaseHandler.start_response and setup_environ; typeshed does not declare them.
    headers: Headers
    environ: dict[str, Any]

    def cleanup_headers(self) -> None:
        super().cleanup_headers()
        self.headers["Connection"] = "close"

    def log_exception(self, exc_info) -> None:
        logger.error("http: %s %s failed", self.environ.get("REQUEST_METHOD"),
                     self.environ.get("PATH_INFO"), exc_info=exc_info)


def _run_wsgi(wsgi: Callable, environ: dict) -> bytes:
    out = io.BytesIO()
    _Gateway(io.BytesIO(b""), out, sys.stderr, environ, multithread=True,
             multiprocess=False).run(wsgi)
    return out.getvalue()


def _canned(status: str, extra: Iterable[tuple[str, str]] = ()) -> bytes:
    """A whole plain-text response for the errors answered outside the WSGI app."""
    text = f"{status}\n".encode()
    head = [f"HTTP/1.1 {status}", f"Date: {formatdate(usegmt=True)}", f"Server: {SERVER}",
            f"{TEXT[0]}: {TEXT[1]}", f"Content-Length: {len(text)}", "Connection: close",
            *(f"{k}: {v}" for k, v in extra)]
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + text


# ------------------------------------------------------------------------- the server

class _BadRequest(Exception):
    def __init__(self, status: str, reason: str = ""):
        super().__init__(reason or status)
        self.status = status


# The request line as RFC 9112 (3) writes it, checked as soon as it has arrived so that
# garbage (TLS to the plain port, a scanner) is answered without waiting for a head that
# never ends; h11 parses the whole request after. A version other than 1.x: 505.
_REQUEST_LINE = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+ [\x21-\x7e]+ HTTP/(\d+)\.\d+\r?")
_TOKEN_START = re.compile(rb"[\r\n!#$%&'*+\-.^_`|~0-9A-Za-z]")
# absolute-form (RFC 9112 3.2.2; RFC 3986 3.2): scheme, authority (userinfo, a host name,
# IPv4 address or bracketed IPv6 literal, port), path, query
_AUTHORITY = (rb"(?:[\w\-.~%!$&'()*+,;=:]*@)?(?:\[[0-9A-Fa-f:.]+\]|[\w\-.~%!$&'()*+,;=]*)"
              rb"(?::[0-9]*)?")
_ABSOLUTE = re.compile(rb"https?://" + _AUTHORITY + rb"(/[^?#]*)?(?:\?([^#]*))?",
                       re.IGNORECASE)
_STATUS = {400: "400 Bad Request", 413: "413 Content Too Large",
           414: "414 URI Too Long", 431: "431 Request Header Fields Too Large",
           501: "501 Not Implemented", 505: "505 HTTP Version Not Supported"}


def _check_request_line(line: bytes) -> None:
    """_BadRequest unless ``line`` (without its LF) is an HTTP/1.x request line."""
    m = _REQUEST_LINE.fullmatch(line)
    if m is None:
        raise _BadRequest(_STATUS[400], "malformed request line")
    if m.group(1) != b"1":
        raise _BadRequest(_STATUS[505])


def _target(target: bytes) -> tuple[str, str]:
    """(path, query) of a request target in origin or absolute form; _BadRequest for
    anything else (asterisk and authority forms are not for this server)."""
    if target.startswith(b"/"):
        path, _, query = target.partition(b"?")
    else:
        m = _ABSOLUTE.fullmatch(target)
        if m is None:
            raise _BadRequest(_STATUS[400], "invalid request target")
        path, query = m.group(1) or b"/", m.group(2) or b""
    return unquote_to_bytes(path).decode("latin-1"), query.decode("latin-1")
