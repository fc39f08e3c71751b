"""The exporter's HTTP server, against real sockets on 127.0.0.1.

Idle and slow clients, connection and in-flight limits, the listen backlog, running out of
file descriptors, malformed requests, gzip negotiation, methods, the Server header, the
health endpoints, the exporter-toolkit web configuration (TLS, mutual TLS, basic auth,
headers) and its validation. Every wait is bounded by a socket timeout or a deadline.
"""

from __future__ import annotations

import base64
import collections
import gzip
import http.client
import os
import socket
import ssl
import subprocess
import sys
import threading
import time
from pathlib import Path

import bcrypt
import pytest
from conftest import HANG_S

from gemmd.config import load_web_config
from gemmd.errors import ConfigError
from gemmd.exporter.access import BasicAuth
from gemmd.exporter.app import gzip_wanted
from gemmd.exporter.exposition import Exposition
from gemmd.exporter.http import serve
from gemmd.state import State

ROOT = Path(__file__).resolve().parent.parent


# ------------------------------------------------------------------------------ helpers

class CountingExposition(Exposition):
    """A real Exposition that counts renders and can be made slow: ``delay`` seconds, or
    until ``gate`` is set (a render that cannot end before the test says so)."""

    def __init__(self, delay: float = 0.0, gate: threading.Event | None = None):
        super().__init__(State(), process=False)
        self.calls = 0
        self.delay = delay
        self.gate = gate

    def body(self, gzip_ok: bool = False) -> bytes:
        self.calls += 1
        if self.delay:
            time.sleep(self.delay)
        if self.gate is not None:
            self.gate.wait(HANG_S)
        return super().body(gzip_ok)


@pytest.fixture
def start():
    servers = []

    def start(exposition: Exposition | None = None, **kw):
        httpd = serve(exposition or CountingExposition(), "127.0.0.1", 0, **kw)
        servers.append(httpd)
        return httpd

    yield start
    for s in servers:
        s.shutdown()
        s.server_close()


def request(port: int, path: str = "/metrics", method: str = "GET", headers=None,
            context: ssl.SSLContext | None = None, timeout: float = 5.0):
    """(status, headers, body) of one request on a new connection."""
    if context is None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    else:
        conn = http.client.HTTPSConnection("127.0.0.1", port, timeout=timeout, context=context)
    try:
        conn.request(method, path, headers=headers or {})
        r = conn.getresponse()
        return r.status, r.headers, r.read()
    finally:
        conn.close()


def raw(port: int, data: bytes, timeout: float = 5.0) -> bytes:
    """Send bytes, return everything the server sends until it closes (bounded)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        return read_all(s, timeout)


def read_all(s: socket.socket, timeout: float) -> bytes:
    out, deadline = b"", time.monotonic() + timeout
    while time.monotonic() < deadline:
        s.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            chunk = s.recv(65536)
        except ConnectionResetError:
            break
        if not chunk:
            return out
        out += chunk
    raise AssertionError(f"the server did not close within {timeout} s; got {out[:200]!r}")


def status_of(response: bytes) -> int:
    assert response.startswith(b"HTTP/1.1 "), response[:100]
    return int(response.split(b" ", 2)[1])


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# -------------------------------------------------------------------- PKI for TLS tests

EXTENSIONS = """\
[server]
subjectAltName=IP:127.0.0.1,IP:::1,DNS:localhost
extendedKeyUsage=serverAuth
keyUsage=critical,digitalSignature
[client]
subjectAltName=DNS:prometheus.example,URI:spiffe://example/prometheus
extendedKeyUsage=clientAuth
keyUsage=critical,digitalSignature
"""


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=30)


def _ec_key_args(key: str) -> list[str]:
    return ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
            "-keyout", key]


def make_ca(d: Path, name: str) -> None:
    _openssl("req", "-x509", *_ec_key_args(f"{name}.key"), "-out", f"{name}.pem", "-days",
             "2", "-subj", f"/CN=gemmd test {name}", "-addext",
             "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign",
             cwd=d)


def make_cert(d: Path, name: str, ca: str, kind: str) -> None:
    _openssl("req", "-new", *_ec_key_args(f"{name}.key"), "-out", f"{name}.csr", "-subj",
             f"/CN={name}", cwd=d)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
             "-CAcreateserial", "-out", f"{name}.pem", "-days", "2", "-extfile", "ext.cnf",
             "-extensions", kind, cwd=d)


def make_pki(d: Path) -> Path:
    """A CA, a server certificate for 127.0.0.1/::1/localhost, a client certificate, and a
    client certificate from another CA; written with the openssl command line."""
    d.mkdir(parents=True, exist_ok=True)
    (d / "ext.cnf").write_text(EXTENSIONS)
    make_ca(d, "ca")
    make_ca(d, "other-ca")
    make_cert(d, "server", "ca", "server")
    make_cert(d, "client", "ca", "client")
    make_cert(d, "stranger", "other-ca", "client")
    return d


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    return make_pki(tmp_path_factory.mktemp("pki"))


def client_context(pki: Path, cert: str | None = None, **kw) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(pki / "ca.pem"))
    if cert:
        ctx.load_cert_chain(str(pki / f"{cert}.pem"), str(pki / f"{cert}.key"))
    for k, v in kw.items():
        setattr(ctx, k, v)
    return ctx


def web_config(tmp_path: Path, text: str):
    p = tmp_path / "web.yml"
    p.write_text(text)
    return load_web_config(p)


def tls_yaml(pki: Path, extra: str = "") -> str:
    return (f"tls_server_config:\n  cert_file: {pki / 'server.pem'}\n"
            f"  key_file: {pki / 'server.key'}\n{extra}")


def hash_of(password: bytes, cost: int = 4) -> str:
    return bcrypt.hashpw(password, bcrypt.gensalt(cost)).decode()


def basic(user: str, password: str) -> dict:
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode())
            .decode()}


# -------------------------------------------------- 1. idle and slow clients, limits

def test_idle_connections_cannot_stop_scrapes(start):
    """More idle connections than the limit: the ones waiting longest are closed, a scrape
    is answered at once (idle connections time out only after an hour here: a scrape that
    waited for a free slot would never be answered)."""
    httpd = start(max_connections=20, read_timeout=3600)
    idle = [socket.create_connection(("127.0.0.1", httpd.server_port), timeout=5)
            for _ in range(60)]
    try:
        status, _, body = request(httpd.server_port, timeout=HANG_S)
        assert status == 200 and b"gemmd_build_info" in body
        # The oldest idle connections were closed by the server (EOF), not left to hang.
        idle[0].settimeout(HANG_S)
        assert idle[0].recv(10) == b""
    finally:
        for s in idle:
            s.close()


def test_idle_and_slow_clients_time_out(start):
    httpd = start(read_timeout=0.5)
    port = httpd.server_port
    # Connected, sending nothing: closed without an answer.
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        assert read_all(s, HANG_S) == b""
    # A request trickled a byte every 0.05 s: cut at the deadline with 408. A timeout per
    # byte (0.5 s) would never fire while the bytes keep coming.
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(b"GET /metrics HTTP/1.1\r\n")
        deadline = time.monotonic() + HANG_S
        got = b""
        while not got and time.monotonic() < deadline:
            try:
                s.sendall(b"X")
            except OSError:
                break
            s.settimeout(0.05)
            try:
                got += s.recv(4096)
            except TimeoutError:
                continue
            except ConnectionResetError:
                break
        got += read_all(s, HANG_S) if got and not got.endswith(b"\n") else b""
        assert status_of(got) == 408


def test_excess_requests_get_503_at_once_not_a_queue(start):
    """One render at a time and one in flight: a second request is answered 503 with
    Retry-After at once; health endpoints are answered meanwhile. The first render cannot
    end until the test has both answers, so neither can have waited for it."""
    gate = threading.Event()
    exp = CountingExposition(gate=gate)
    httpd = start(exp, workers=1, max_inflight=1)
    port = httpd.server_port
    first: list = []
    t = threading.Thread(target=lambda: first.append(request(port, timeout=HANG_S)))
    t.start()
    try:
        deadline = time.monotonic() + HANG_S
        while exp.calls == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        status, headers, _ = request(port)
        assert status == 503 and headers["Retry-After"] == "1"
        assert request(port, "/-/healthy")[0] == 200
        assert not first  # still rendering
    finally:
        gate.set()
    t.join(timeout=HANG_S)
    assert first and first[0][0] == 200


def test_a_hundred_concurrent_scrapes_are_all_served_beside_300_idle_clients(start):
    """Issue 24: 100 parallel scrapes while 300 idle connections were open got 32-39
    answers, the rest 503 (32 in flight). Scrapes that arrive together share one render;
    all of them are served."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 1200 and (hard == resource.RLIM_INFINITY or hard >= 1200):
        resource.setrlimit(resource.RLIMIT_NOFILE, (1200, hard))
    elif soft < 1200:
        pytest.skip(f"open-file limit {soft}")
    exp = CountingExposition()
    httpd = start(exp, max_connections=512, read_timeout=60)
    port = httpd.server_port
    idle = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(300)]
    try:
        socks = [socket.create_connection(("127.0.0.1", port), timeout=10)
                 for _ in range(100)]
        for s in socks:  # all 100 requests are in before the first answer is read
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\nAccept-Encoding: gzip\r\n\r\n")
        statuses = []
        for s in socks:
            statuses.append(status_of(read_all(s, 20)))
            s.close()
        assert statuses == [200] * 100, collections.Counter(statuses)
        assert exp.calls == 100
        assert exp.renders == 1  # one render of the state's families, shared by all
    finally:
        for s in idle:
            s.close()


def test_listen_backlog_holds_a_burst_while_the_server_is_busy(start):
    """While the event loop is blocked, 100 clients still complete their TCP handshake
    (backlog 128; with 5, most would wait for SYN retransmits) and are all served after."""
    httpd = start()
    release = threading.Event()
    httpd.loop.call_soon_threadsafe(release.wait, 10)  # block the loop
    socks = []
    try:
        for _ in range(100):
            s = socket.socket()
            s.settimeout(0.5)
            s.connect(("127.0.0.1", httpd.server_port))  # TimeoutError if not queued
            socks.append(s)
        release.set()
        for s in socks:
            s.settimeout(5)
            s.sendall(b"GET /-/healthy HTTP/1.1\r\nHost: x\r\n\r\n")
        assert all(status_of(read_all(s, HANG_S)) == 200 for s in socks)
    finally:
        release.set()
        for s in socks:
            s.close()


EMFILE_SERVER = """
import logging, os, resource, sys, time
logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(message)s")
from gemmd.exporter.exposition import Exposition
from gemmd.exporter.http import serve
from gemmd.state import State
httpd = serve(Exposition(State(), process=False), "127.0.0.1", 0, max_connections=10000,
              read_timeout=60)
n = len(os.listdir("/proc/self/fd"))
resource.setrlimit(resource.RLIMIT_NOFILE, (n + 20, resource.getrlimit(
    resource.RLIMIT_NOFILE)[1]))
print(httpd.server_port, flush=True)
time.sleep(60)
"""


def test_out_of_file_descriptors_backs_off_logs_once_and_recovers(tmp_path):
    """With the connection limit above the open-file limit, idle clients exhaust the
    descriptors: accept() backs off instead of spinning a core, the log says so once, and
    scrapes work again as soon as the idle clients are gone."""
    log = tmp_path / "server.log"
    with open(log, "wb") as err:
        p = subprocess.Popen([sys.executable, "-c", EMFILE_SERVER], stdout=subprocess.PIPE,
                             stderr=err, cwd=ROOT)
    idle: list[socket.socket] = []
    try:
        port = int(p.stdout.readline())
        for _ in range(60):
            s = socket.socket()
            s.settimeout(0.5)
            try:
                s.connect(("127.0.0.1", port))
            except OSError:
                s.close()
                break
            idle.append(s)
        time.sleep(1.0)
        c0, t0 = cpu_seconds(p.pid), time.monotonic()
        time.sleep(2.0)
        share = (cpu_seconds(p.pid) - c0) / (time.monotonic() - t0)
        assert share < 0.2, f"the server used {share:.0%} of a core while out of descriptors"
        for s in idle:
            s.close()
        idle.clear()
        deadline, status = time.monotonic() + HANG_S, None
        while time.monotonic() < deadline and status != 200:
            try:
                status = request(port, "/metrics", timeout=3)[0]
            except OSError:
                time.sleep(0.2)
        assert status == 200
    finally:
        for s in idle:
            s.close()
        p.kill()
        p.wait(timeout=10)
    text = log.read_text()
    assert text.count("cannot accept connections: [Errno 24]") == 1, text
    assert "accepting connections again" in text


# ------------------------------------------------------------------- 2. bad requests

@pytest.mark.parametrize("data, status", [
    (b"GARBAGE\r\n\r\n", 400),
    (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n", 400),  # TLS to plain HTTP
    (b"GET /metrics\r\n\r\n", 400),  # HTTP/0.9
    (b"GET  /metrics HTTP/1.1\r\n\r\n", 400),
    (b"GET metrics HTTP/1.1\r\n\r\n", 400),
    (b"GET /metrics HTTP/1.1\r\nno colon here\r\n\r\n", 400),
    (b"GET /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: x\r\n\r\n", 400),
    (b"GET /metrics HTTP/2.0\r\n\r\n", 505),
    (b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", 505),  # HTTP/2 prior knowledge
    (b"GET /metrics HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
     501),
    (b"GET /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 999999999\r\n\r\n", 413),
    (b"GET /" + b"a" * 20000 + b" HTTP/1.1\r\n\r\n", 414),
    (b"GET /metrics HTTP/1.1\r\nHost: x\r\n" + b"X-A: b\r\n" * 2000 + b"\r\n", 431),
    # Issue 24 (a hand-written parser's classic bugs; h11 parses now): targets urlsplit
    # raised on (no answer at all), Content-Length in non-ASCII digits (str.isdigit) or
    # past int()'s 4,300 digits, a CR before the CRLF, HTTP/1.1 without Host or with two.
    (b"GET http://[/metrics HTTP/1.1\r\nHost: x\r\n\r\n", 400),
    (b"GET http://[::1/metrics HTTP/1.1\r\nHost: x\r\n\r\n", 400),
    (b"GET https://a]b/metrics HTTP/1.1\r\nHost: x\r\n\r\n", 400),
    ("GET /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: \u00b2\r\n\r\n".encode("latin-1"),
     400),
    ("GET /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: \u00b9\r\n\r\n".encode(), 400),
    (b"GET /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: " + b"9" * 5000 + b"\r\n\r\n",
     400),
    (b"GET /metrics HTTP/1.1\r\r\n\r\n", 400),
    (b"GET /metrics HTTP/1.1\r\n\r\n", 400),  # no Host
    (b"GET /metrics HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", 400),
    (b"GET /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n",
     400),
    (b"GET /metrics HTTP/1.1\r\nHost: x\r\nX: a\x00b\r\n\r\n", 400),
    (b"GET /metrics HTTP/1.1\r\nHost : x\r\n\r\n", 400),
    (b"GET * HTTP/1.1\r\nHost: x\r\n\r\n", 400),
    (b"GET /metrics HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n\r\n", 501),
    (b"GET /metrics HTTP/9.9\r\nHost: x\r\n\r\n", 505),
])
def test_malformed_requests_get_an_answer_and_are_closed(start, data, status):
    httpd = start()
    got = raw(httpd.server_port, data)  # read_all: the server closes, or the test fails
    assert status_of(got) == status
    assert b"\r\nConnection: close\r\n" in got and b"\r\nServer: gemmd\r\n" in got


def test_garbage_line_is_answered_before_the_head_ends(start):
    """A garbage first line is answered at once, without waiting for more (the head's
    deadline is an hour away here)."""
    httpd = start(read_timeout=3600)
    with socket.create_connection(("127.0.0.1", httpd.server_port), timeout=5) as s:
        s.sendall(b"\x00\x01garbage\r\n")
        assert status_of(read_all(s, HANG_S)) == 400


def test_a_request_with_a_body_and_a_half_close_still_get_an_answer(start):
    httpd = start()
    with socket.create_connection(("127.0.0.1", httpd.server_port), timeout=5) as s:
        s.sendall(b"POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello")
        s.shutdown(socket.SHUT_WR)
        got = read_all(s, 5)
    assert status_of(got) == 405 and b"\r\nAllow: GET, HEAD\r\n" in got
    # Leading empty lines and bare LF line ends are tolerated (RFC 9112 2.2).
    got = raw(httpd.server_port, b"\r\n\r\nGET /-/healthy HTTP/1.0\n\n")
    assert status_of(got) == 200
    # Obsolete line folding is replaced by a space (RFC 9112 5.2 allows that or 400); a
    # well-formed absolute-form target is served.
    for data in (b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-A: b\r\n folded\r\n\r\n",
                 b"GET http://user@[::1]:9477/metrics?x=1 HTTP/1.1\r\nHost: x\r\n\r\n",
                 b"GET http://127.0.0.1/metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"):
        assert status_of(raw(httpd.server_port, data)) == 200, data


# ----------------------------------------------------------------------------- 3. gzip

@pytest.mark.parametrize("header, gz", [
    ("gzip", True), ("GZIP", True), ("gzip, deflate, br", True), ("deflate, gzip;q=0.5", True),
    ("gzip;q=1.0", True), ("gzip ; q=0.001", True),
    ("gzip;q=0", False), ("gzip; q=0.000", False), ("gzip;q=0, identity", False),
    ("nogzip", False), ("x-gzipped", False), ("identity", False), ("", False), (None, False),
    ("gzip;q=abc", False), ("gzip;q=2", False),
])
def test_gzip_only_when_acceptable(start, header, gz):
    assert gzip_wanted(header) is gz
    httpd = start()
    status, headers, body = request(httpd.server_port,
                                    headers={} if header is None else
                                    {"Accept-Encoding": header})
    assert status == 200
    assert (headers["Content-Encoding"] == "gzip") is gz
    assert b"gemmd_build_info" in (gzip.decompress(body) if gz else body)
    assert headers["Vary"] == "Accept-Encoding"


# ----------------------------------------------------------- 4. methods, 5. Server header

@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE", "OPTIONS", "PATCH", "TRACE"])
def test_other_methods_get_405_with_allow(start, method):
    httpd = start()
    status, headers, _ = request(httpd.server_port, method=method)
    assert status == 405 and headers["Allow"] == "GET, HEAD"


def test_head_sends_headers_without_a_body(start):
    httpd = start()
    _, get_headers, body = request(httpd.server_port)
    for path in ("/metrics", "/", "/nope", "/-/healthy"):
        got = raw(httpd.server_port, f"HEAD {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        head, _, rest = got.partition(b"\r\n\r\n")
        assert rest == b"", path  # nothing after the headers
        assert b"\r\nContent-Length: " in head
    got = raw(httpd.server_port, b"HEAD /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
    length = int(got.split(b"Content-Length: ")[1].split(b"\r\n")[0])
    assert abs(length - len(body)) < 200  # as GET's (the live gauges' digits vary)
    assert get_headers["Content-Length"] == str(len(body))


def test_server_header_names_no_versions(start):
    httpd = start()
    port = httpd.server_port
    answers = [request(port, p)[1]["Server"] for p in ("/metrics", "/", "/nope")]
    answers.append(request(port, method="POST")[1]["Server"])
    assert answers == ["gemmd"] * 4
    for data in (b"GARBAGE\r\n\r\n", b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
                 b"GET / HTTP/1.1\r\n\r\n"):
        got = raw(port, data)
        assert b"Python" not in got and b"WSGIServer" not in got


def test_not_found_and_landing_page(start):
    httpd = start()
    assert request(httpd.server_port, "/nope")[0] == 404
    status, headers, body = request(httpd.server_port, "/")
    assert status == 200 and b"/metrics" in body and headers["Content-Type"].startswith(
        "text/html")


def test_the_runbook_is_served_with_a_section_per_alert(start):
    """/runbook: docs/runbook.md as HTML, one anchor per section as GitHub names them (what
    the rules' runbook_urls link); /runbook.md: the Markdown; both from the text that
    travels in the package, in step with docs/runbook.md."""
    import re
    import subprocess
    import sys

    from gemmd.exporter import runbook

    exp = CountingExposition()
    port = start(exp).server_port
    status, headers, body = request(port, "/runbook")
    assert status == 200 and headers["Content-Type"] == "text/html; charset=utf-8"
    page = body.decode()
    doc = (ROOT / "docs" / "runbook.md").read_text()
    sections = [runbook.anchor(line[3:]) for line in doc.splitlines() if line.startswith("## ")]
    assert sections and all(f'<h2 id="{a}">' in page for a in sections)
    assert "<table>" in page and "<pre><code>" in page and "<script" not in page
    status, headers, body = request(port, "/runbook.md")
    assert status == 200 and headers["Content-Type"] == "text/markdown; charset=utf-8"
    assert body.decode() == doc
    assert request(port, "/runbook", method="HEAD")[2] == b""
    assert exp.calls == 0
    r = subprocess.run([sys.executable, "-m", "gemmd.exporter.runbook", "--check"],
                       capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    # Markdown is escaped, links to the repository's other files become text.
    html_ = runbook.to_html("## A <b> & `x<y>`\n\nsee [drift](docs/drift.md), "
                            "[up](https://example.org/a?b=1&c=2)\n")
    assert '<h2 id="a-b--xy">A &lt;b&gt; &amp; <code>x&lt;y&gt;</code></h2>' in html_
    assert "see drift, " in html_ and 'href="https://example.org/a?b=1&amp;c=2"' in html_
    assert not re.search(r"<b>", html_)


# ------------------------------------------------------------------- 6. health endpoints

def test_health_endpoints_never_render_metrics(start):
    exp = CountingExposition()
    state = {"ready": False}

    def ready():
        if state["ready"] is None:
            raise RuntimeError("store closed")
        return state["ready"]

    httpd = start(exp, ready=ready)
    port = httpd.server_port
    assert request(port, "/-/healthy")[:1] == (200,)
    assert request(port, "/-/ready")[0] == 503
    state["ready"] = True
    assert request(port, "/-/ready")[0] == 200
    state["ready"] = None  # ready() failing means not ready, not a 500
    assert request(port, "/-/ready")[0] == 503
    assert exp.calls == 0
    # Without a ready() callable, serving is ready.
    assert request(start().server_port, "/-/ready")[0] == 200


# ------------------------------------------------------------------- 7. web config files

def test_web_config_full_file_loads(tmp_path, pki):
    (tmp_path / "certs").symlink_to(pki)
    h = hash_of(b"secret")
    cfg = web_config(tmp_path, f"""
tls_server_config:
  cert_file: certs/server.pem        # relative to the web config's directory
  key_file: certs/server.key
  client_ca_file: certs/ca.pem
  client_auth_type: RequireAndVerifyClientCert
  client_allowed_sans: [prometheus.example]
  min_version: TLS12
  max_version: TLS13
  cipher_suites: [TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256]
  prefer_server_cipher_suites: true
http_server_config:
  http2: false
  headers:
    X-Frame-Options: deny
    Strict-Transport-Security: max-age=31536000
    Content-Security-Policy: ""
basic_auth_users:
  prometheus: {h}
  # htpasswd -nBC 10 writes $2y$
  other: {h.replace("$2b$", "$2y$", 1)}
""")
    assert cfg.tls.cert_file == str(tmp_path.resolve() / "certs" / "server.pem")
    assert cfg.tls.client_auth_type == "RequireAndVerifyClientCert"
    assert cfg.tls.client_allowed_sans == ("prometheus.example",)
    assert cfg.headers == (("X-Frame-Options", "deny"),
                           ("Strict-Transport-Security", "max-age=31536000"))
    assert set(cfg.users) == {"prometheus", "other"} and cfg.http2 is False
    assert load_web_config(_write(tmp_path / "empty.yml", "")).tls is None


def _write(p: Path, text: str) -> Path:
    p.write_text(text)
    return p


def test_web_config_problems_are_one_line_each_naming_file_and_key(tmp_path, pki):
    secret_looking = "plaintext-password"
    p = _write(tmp_path / "web.yml", f"""
tls_server_config:
  cert_file: missing.pem
  key_file: {tmp_path}
  client_auth_type: RequireSomething
  min_version: TLS14
  cipher_suites: [TLS_RSA_WITH_RC4_128_SHA]
  curve_preferences: [X25519]
http_server_config:
  headers:
    X-Powered-By: gemmd
    X-Frame-Options: allow
basic_auth_users:
  alice: {secret_looking}
  "bob:x": {hash_of(b"pw")}
rate_limit: {{interval: 1s, burst: 10}}
something: else
""")
    with pytest.raises(ConfigError) as e:
        load_web_config(p)
    err = e.value
    assert err.source == str(p)
    text = "\n".join(err.problems)
    assert all("\n" not in prob for prob in err.problems)
    for needle in (
            f"tls_server_config.cert_file: cannot read {tmp_path / 'missing.pem'}: "
            "No such file or directory",
            f"tls_server_config.key_file: cannot read {tmp_path}: Is a directory",
            "tls_server_config.client_auth_type: 'RequireSomething' is not one of",
            "tls_server_config.min_version: 'TLS14' is not one of",
            "tls_server_config.cipher_suites: unknown or insecure cipher suite "
            "'TLS_RSA_WITH_RC4_128_SHA'",
            "tls_server_config.curve_preferences: not supported",
            "http_server_config.headers.X-Powered-By: this header cannot be configured",
            "http_server_config.headers.X-Frame-Options: 'allow' is not one of deny, "
            "sameorigin",
            "basic_auth_users.alice: not a bcrypt hash",
            "basic_auth_users.bob:x: a user name is a non-empty string without ':'",
            "rate_limit: not supported",
            "something: unknown key"):
        assert needle in text, f"{needle!r} not in:\n{text}"
    assert secret_looking not in str(err)  # a password (hash) is never echoed


def test_web_config_refuses_bcrypt_costs_that_take_seconds_and_fifos(tmp_path, pki):
    """Issue 24: cost 31 passed and `gemmd run` then hashed a decoy at that cost on its
    main thread (days, deaf to SIGTERM); a FIFO as the web config, certificate or key
    hung check-config and run (open() waits for a writer)."""
    salt = hash_of(b"pw")[7:]
    p = _write(tmp_path / "web.yml", f"""
basic_auth_users:
  slow: $2b$31${salt}
  fast: $2b$03${salt}
  ok: $2b$14${salt}
""")
    with pytest.raises(ConfigError) as e:
        load_web_config(p)
    text = "\n".join(e.value.problems)
    assert "basic_auth_users.slow: bcrypt cost 31 is outside 04-14 (each check would take " \
           "about 35 hours of CPU)" in text
    assert "basic_auth_users.fast: bcrypt cost 3 is outside 04-14;" in text
    assert "basic_auth_users.ok" not in text
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    t = time.monotonic()
    for text in (tls_yaml(pki).replace(str(pki / "server.pem"), str(fifo)),
                 tls_yaml(pki).replace(str(pki / "server.key"), str(fifo))):
        with pytest.raises(ConfigError) as e:
            load_web_config(_write(tmp_path / "web.yml", text))
        assert f"cannot read {fifo}: not a regular file (a named pipe)" in str(e.value)
    with pytest.raises(ConfigError) as e:
        load_web_config(fifo)
    assert "named pipe" in str(e.value)
    assert time.monotonic() - t < 5


@pytest.mark.parametrize("extra, needle", [
    ("", None),
    ("  client_auth_type: RequireAndVerifyClientCert\n",
     "tls_server_config.client_ca_file: required with client_auth_type "
     "RequireAndVerifyClientCert"),
    ("  client_ca_file: ca.pem\n", "tls_server_config.client_ca_file: given without a "
                                   "client_auth_type"),
    ("  client_allowed_sans: [x]\n  client_ca_file: ca.pem\n"
     "  client_auth_type: VerifyClientCertIfGiven\n",
     "tls_server_config.client_allowed_sans: requires client_auth_type"),
    ("  min_version: TLS13\n  max_version: TLS12\n",
     "tls_server_config.min_version: TLS13 is above max_version TLS12"),
])
def test_web_config_tls_consistency(tmp_path, pki, extra, needle):
    p = _write(tmp_path / "web.yml", tls_yaml(pki, extra.replace("ca.pem",
                                                                  str(pki / "ca.pem"))))
    if needle is None:
        assert load_web_config(p).tls is not None
        return
    with pytest.raises(ConfigError) as e:
        load_web_config(p)
    assert any(needle in prob for prob in e.value.problems), e.value.problems


def test_web_config_certificate_must_match_its_key(tmp_path, pki):
    p = _write(tmp_path / "web.yml", f"tls_server_config:\n  cert_file: {pki / 'server.pem'}"
               f"\n  key_file: {pki / 'client.key'}\n")
    with pytest.raises(ConfigError, match="tls_server_config.cert_file/key_file/"
                       "client_ca_file: cannot load them: .*KEY_VALUES_MISMATCH"):
        load_web_config(p)
    p = _write(tmp_path / "web.yml", "tls_server_config:\n  min_version: TLS13\n")
    with pytest.raises(ConfigError, match="tls_server_config.cert_file: missing"):
        load_web_config(p)
    with pytest.raises(ConfigError, match="cannot read"):
        load_web_config(tmp_path / "nonexistent.yml")
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_web_config(_write(tmp_path / "bad.yml", "tls_server_config: [\n"))


# ------------------------------------------------------------------------------- TLS

def test_https_scrape_and_plain_http_refused(start, tmp_path, pki):
    cfg = web_config(tmp_path, tls_yaml(pki, "  min_version: TLS13\n"))
    httpd = start(web_config=cfg)
    port = httpd.server_port
    status, headers, body = request(port, context=client_context(pki))
    assert status == 200 and b"gemmd_build_info" in body and headers["Server"] == "gemmd"
    # Plain HTTP to the TLS port: no HTTP answer, the connection is closed.
    assert not raw(port, b"GET /metrics HTTP/1.1\r\n\r\n").startswith(b"HTTP/")
    # Below min_version: refused in the handshake.
    with pytest.raises(ssl.SSLError):
        request(port, context=client_context(pki, maximum_version=ssl.TLSVersion.TLSv1_2))


def test_tls_idle_handshakes_time_out_and_are_evicted(start, tmp_path, pki):
    httpd = start(web_config=web_config(tmp_path, tls_yaml(pki)), read_timeout=0.5,
                  max_connections=16)
    port = httpd.server_port
    idle = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(40)]
    try:
        assert request(port, context=client_context(pki))[0] == 200
        assert read_all(idle[-1], HANG_S) == b""  # no ClientHello: closed after read_timeout
    finally:
        for s in idle:
            s.close()


def test_mutual_tls_requires_a_certificate_from_the_client_ca(start, tmp_path, pki):
    cfg = web_config(tmp_path, tls_yaml(pki, f"  client_ca_file: {pki / 'ca.pem'}\n"
                                             "  client_auth_type: RequireAndVerifyClientCert\n"))
    port = start(web_config=cfg).server_port
    assert request(port, context=client_context(pki, "client"))[0] == 200
    for who in (None, "stranger"):  # no certificate; one from another CA
        with pytest.raises((ssl.SSLError, ConnectionError)):
            request(port, context=client_context(pki, who))


def test_verify_client_cert_if_given(start, tmp_path, pki):
    cfg = web_config(tmp_path, tls_yaml(pki, f"  client_ca_file: {pki / 'ca.pem'}\n"
                                             "  client_auth_type: VerifyClientCertIfGiven\n"))
    port = start(web_config=cfg).server_port
    assert request(port, context=client_context(pki))[0] == 200
    assert request(port, context=client_context(pki, "client"))[0] == 200
    with pytest.raises((ssl.SSLError, ConnectionError)):
        request(port, context=client_context(pki, "stranger"))


@pytest.mark.parametrize("sans, ok", [(["prometheus.example"], True),
                                      (["spiffe://example/prometheus"], True),
                                      (["grafana.example", "10.0.0.1"], False)])
def test_client_allowed_sans(start, tmp_path, pki, sans, ok):
    cfg = web_config(tmp_path, tls_yaml(pki, f"  client_ca_file: {pki / 'ca.pem'}\n"
                                             "  client_auth_type: RequireAndVerifyClientCert\n"
                                             f"  client_allowed_sans: {sans}\n"))
    port = start(web_config=cfg).server_port
    if ok:
        assert request(port, context=client_context(pki, "client"))[0] == 200
    else:
        with pytest.raises((ssl.SSLError, ConnectionError, http.client.HTTPException)):
            request(port, context=client_context(pki, "client"))


def test_certificate_files_are_reloaded_when_they_change(start, tmp_path, pki, caplog):
    d = tmp_path / "live"
    d.mkdir()
    for f in ("server.pem", "server.key"):
        (d / f).write_bytes((pki / f).read_bytes())
    cfg = web_config(tmp_path, f"tls_server_config:\n  cert_file: {d / 'server.pem'}\n"
                               f"  key_file: {d / 'server.key'}\n")
    port = start(web_config=cfg).server_port

    def served_serial() -> int:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s, \
                client_context(pki).wrap_socket(s, server_hostname="127.0.0.1") as t:
            return int(t.getpeercert()["serialNumber"], 16)

    first = served_serial()
    make_cert(pki, "server2", "ca", "server")
    (d / "server.key").write_bytes((pki / "server2.key").read_bytes())
    (d / "server.pem").write_bytes((pki / "server2.pem").read_bytes())
    deadline = time.monotonic() + HANG_S
    while served_serial() == first:
        assert time.monotonic() < deadline, "the new certificate was never served"
        time.sleep(0.3)
    (d / "server.pem").write_text("not a certificate")  # broken: keeps the last good one
    deadline = time.monotonic() + HANG_S
    while "cannot be loaded" not in caplog.text:  # until the server has seen the change
        assert time.monotonic() < deadline, "the broken certificate was never noticed"
        time.sleep(0.3)
        served_serial()  # a handshake is what makes the server look at the files
    assert served_serial() != first


# ------------------------------------------------------------------------- basic auth

def test_basic_auth(start, tmp_path, pki):
    cfg = web_config(tmp_path, tls_yaml(pki) + f"""
basic_auth_users:
  prometheus: {hash_of(b"s3cret")}
http_server_config:
  headers:
    X-Content-Type-Options: nosniff
""")
    exp = CountingExposition()
    port = start(exp, web_config=cfg, ready=lambda: True).server_port
    ctx = client_context(pki)
    for headers in ({}, basic("prometheus", "wrong"), basic("nobody", "s3cret"),
                    {"Authorization": "Basic !!!notbase64"},
                    {"Authorization": "Bearer s3cret"},
                    {"Authorization": "Basic " + base64.b64encode(b"prometheus").decode()}):
        status, h, _ = request(port, headers=headers, context=ctx)
        assert status == 401, headers
        assert h["WWW-Authenticate"] == 'Basic realm="gemmd"'
        assert h["X-Content-Type-Options"] == "nosniff"
    assert request(port, "/", headers={}, context=ctx)[0] == 401
    assert exp.calls == 0
    status, h, body = request(port, headers=basic("prometheus", "s3cret"), context=ctx)
    assert status == 200 and b"gemmd_build_info" in body
    assert h["X-Content-Type-Options"] == "nosniff"
    # Health endpoints are exempt: Kubernetes and Docker probes send no credentials.
    assert request(port, "/-/healthy", context=ctx)[0] == 200
    assert request(port, "/-/ready", context=ctx)[0] == 200
    # So is the runbook an alert links: opened in a browser, the same on every host.
    calls = exp.calls
    status, h, body = request(port, "/runbook", context=ctx)
    assert status == 200 and b'id="gemmddown"' in body
    assert h["X-Content-Type-Options"] == "nosniff"
    assert exp.calls == calls


def test_basic_auth_caches_bcrypt_and_compares_in_constant_time(monkeypatch):
    auth = BasicAuth({"prometheus": hash_of(b"s3cret", cost=10), "other": hash_of(b"x")})
    calls = []
    real = auth._checkpw
    monkeypatch.setattr(auth, "_checkpw", lambda pw, h: calls.append(pw) or real(pw, h))
    good = basic("prometheus", "s3cret")["Authorization"]
    for _ in range(101):
        assert auth.check(good)
    assert len(calls) == 1  # bcrypt ran once; the other 100 checks were answered from the cache
    # A wrong password is checked by bcrypt once, then refused from the cache.
    bad = basic("prometheus", "guess")["Authorization"]
    assert not auth.check(bad) and not auth.check(bad)
    assert len(calls) == 2
    # An unknown user still costs a bcrypt check (no user enumeration by timing) and a
    # password that bcrypt refuses outright (over 72 bytes) is simply wrong.
    assert not auth.check(basic("nobody", "s3cret")["Authorization"])
    assert not auth.check(basic("prometheus", "x" * 100)["Authorization"])
    assert len(calls) == 4
    # The previously verified password still works; another user's is independent.
    assert auth.check(good) and auth.check(basic("other", "x")["Authorization"])


def test_wrong_passwords_never_starve_a_good_scrape(start, tmp_path, monkeypatch, caplog):
    """Issue 24: 32 clients sending distinct wrong passwords filled the 32 in-flight slots
    with bcrypt checks; Prometheus's scrape got 200 in 2 of 40 tries. Now a verified
    credential is answered from the cache (no bcrypt, no slot), a new one from an address
    without failures is checked first, wrong ones are limited per address (429) and in
    CPU, and logged once. bcrypt is made slow by sleeping (no CPU: any machine speed)."""
    from gemmd.exporter.access import _AuthGate

    real, calls = bcrypt.checkpw, []

    def slow(password, hashed):
        calls.append(password)
        time.sleep(0.1)
        return real(password, hashed)

    monkeypatch.setattr(bcrypt, "checkpw", slow)
    cfg = web_config(tmp_path, f"basic_auth_users:\n  prometheus: {hash_of(b's3cret')}\n")
    port = start(CountingExposition(), web_config=cfg).server_port
    good = basic("prometheus", "s3cret")
    stop, lock, got = threading.Event(), threading.Lock(), collections.Counter()

    def attacker(i: int) -> None:
        n = 0
        while not stop.is_set():
            n += 1
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10,
                                              source_address=(f"127.0.0.{2 + i % 4}", 0))
            try:
                conn.request("GET", "/metrics", headers=basic("prometheus", f"guess-{i}-{n}"))
                status: int | str = conn.getresponse().status
            except OSError as e:
                status = type(e).__name__
            finally:
                conn.close()
            with lock:
                got[status] += 1
            stop.wait(0.02)

    t0 = time.monotonic()
    attackers = [threading.Thread(target=attacker, args=(i,)) for i in range(32)]
    for t in attackers:
        t.start()
    try:
        time.sleep(0.5)
        lat = []
        for _ in range(20):  # the first one needs bcrypt: its address has no failures
            t = time.monotonic()
            status = request(port, headers=good, timeout=10)[0]
            lat.append(time.monotonic() - t)
            assert status == 200, got
    finally:
        stop.set()
        for t in attackers:
            t.join(timeout=15)
    elapsed = time.monotonic() - t0
    assert max(lat[1:]) < 1.0 and lat[0] < 2.0, lat
    assert set(got) <= {401, 429, 503} and got[429] > got[401], got
    # bcrypt ran for the good password, each address's burst and then one failure per
    # FAIL_EVERY_S per address (4 addresses), not once per attempt.
    bound = 1 + 4 * (_AuthGate.FAIL_BURST + elapsed / _AuthGate.FAIL_EVERY_S + 1)
    assert len(calls) <= bound, (len(calls), bound, got)
    assert caplog.text.count("failed basic-auth attempt") == 1, caplog.text


# --------------------------------------------------------------------- lifecycle, IPv6

def test_clients_that_vanish_leave_nothing_behind(start, tmp_path, pki):
    """Clients that hang up mid-handshake, mid-request or before their answer: every
    connection and in-flight slot is released."""
    for cfg in (None, web_config(tmp_path, tls_yaml(pki))):
        httpd = start(CountingExposition(delay=0.05), web_config=cfg)
        port = httpd.server_port
        for i in range(30):
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            if i % 3 == 0:
                s.sendall(b"\x16\x03\x01" if cfg else b"GET /met")
            elif cfg is None:
                s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            s.close()
        ctx = client_context(pki) if cfg else None
        assert request(port, context=ctx)[0] == 200
        deadline = time.monotonic() + HANG_S
        while (httpd.conns or httpd.inflight) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not httpd.conns and httpd.inflight == 0 and not httpd.waiting


def test_shutdown_closes_the_port(start):
    httpd = start()
    port = httpd.server_port
    assert request(port, "/-/healthy")[0] == 200
    httpd.shutdown()
    httpd.server_close()
    httpd.server_close()  # idempotent
    with pytest.raises(OSError):
        request(port, "/-/healthy", timeout=2)


def test_ipv6(start):
    if not socket.has_ipv6:
        pytest.skip("no IPv6")
    try:
        httpd = serve(CountingExposition(), "::1", 0)
    except OSError as e:
        pytest.skip(f"no IPv6 loopback: {e}")
    try:
        conn = http.client.HTTPConnection("::1", httpd.server_port, timeout=5)
        conn.request("GET", "/-/healthy")
        assert conn.getresponse().status == 200
        conn.close()
    finally:
        httpd.shutdown()
        httpd.server_close()


# -------------------------------------------------- the daemon, wired

@pytest.mark.parametrize("text", ["tls_server_config: {}\n", "tls_server_config:\n",
                                  "basic_auth_users: {}\n", ""])
def test_a_web_config_without_tls_serves_and_says_plain_http(start, tmp_path, text):
    """Issue 24: with `tls_server_config: {}` or null, or basic auth only, the daemon said
    `metrics on https://...` while it served plain HTTP (it looked at the file's name)."""
    httpd = start(web_config=web_config(tmp_path, text))
    assert httpd.scheme == "http"
    assert request(httpd.server_port, "/-/healthy")[0] == 200


def test_gemmd_run_serves_https_with_basic_auth_from_its_config(tmp_path, pki, caplog):
    """listen.web_config_file (relative to the config file) reaches the daemon: HTTPS,
    basic auth, /-/ready once the jobs run; a wrong password gets 401."""
    import dataclasses
    import urllib.error
    import urllib.request

    from gemmd.config import load
    from gemmd.daemon import Daemon

    (tmp_path / "web.yml").write_text(
        tls_yaml(pki) + f"basic_auth_users:\n  prom: {hash_of(b's3cret')}\n")
    cfg_path = tmp_path / "gemmd.yaml"
    cfg_path.write_text("backend: fake\nlisten: {address: 127.0.0.1, port: 0, "
                        "web_config_file: web.yml}\nprobes: {measure: {window_s: 0.2, "
                        f"warmup_s: 0}}}}\nstate_dir: {tmp_path / 'state'}\n")
    cfg = load(cfg_path)
    assert cfg.listen.web_config_file == str(tmp_path / "web.yml")
    d = Daemon(dataclasses.replace(cfg))
    caplog.set_level("INFO", "gemmd.daemon")
    d.start()
    try:
        assert f"metrics on https://127.0.0.1:{d.port}/metrics" in caplog.text
        ctx = client_context(pki)
        base = f"https://127.0.0.1:{d.port}"
        with urllib.request.urlopen(base + "/-/ready", context=ctx, timeout=10) as r:
            assert r.status == 200
        req = urllib.request.Request(base + "/metrics", headers=basic("prom", "s3cret"))
        with urllib.request.urlopen(req, context=ctx, timeout=10) as r:
            assert b"gemmd_build_info" in r.read()
        bad = urllib.request.Request(base + "/metrics", headers=basic("prom", "wrong"))
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(bad, context=ctx, timeout=10)
        assert e.value.code == 401
    finally:
        d.stop()


def _docker_healthcheck(port: int) -> int:
    """Run the Dockerfile's HEALTHCHECK command as the image would, on ``port``."""
    import json
    import re

    text = (ROOT / "Dockerfile").read_text()
    cmd = json.loads(re.search(r"^\s+CMD (\[\"python\", \"-c\".*\])$", text, re.M).group(1))
    script = cmd[2].replace("127.0.0.1:9477", f"127.0.0.1:{port}")
    return subprocess.run([sys.executable, "-c", script], capture_output=True,
                          timeout=30).returncode


def test_the_images_healthcheck_passes_over_http_and_https_and_fails_when_nothing_serves(
        start, tmp_path, pki):
    assert _docker_healthcheck(start().server_port) == 0
    tls = start(web_config=web_config(tmp_path, tls_yaml(pki)))
    assert _docker_healthcheck(tls.server_port) == 0
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    free = s.getsockname()[1]
    s.close()
    assert _docker_healthcheck(free) == 1


# ------------------------------------------- a sample of bench/fuzz_http.py (issue 24)

def test_a_sample_of_hostile_requests_each_gets_the_right_answer(start):
    """Every class of bench/fuzz_http.py (targets, versions, Host, Content-Length,
    Transfer-Encoding, line ends, control bytes, sizes, garbage) plus random damage: every
    request gets a status line, a defect a 4xx/5xx, a valid request a 2xx."""
    import concurrent.futures
    import datetime
    import importlib.util
    import random

    spec = importlib.util.spec_from_file_location("fuzz_http", ROOT / "bench" / "fuzz_http.py")
    assert spec and spec.loader
    fuzz = importlib.util.module_from_spec(spec)
    sys.modules["fuzz_http"] = fuzz  # its dataclasses look their module up while defined
    spec.loader.exec_module(fuzz)
    seed = int(datetime.date.today().strftime("%Y%m%d"))
    r = random.Random(seed)
    cases = fuzz.cases_of_class(r) + [fuzz.random_case(r) for _ in range(100)]
    httpd = start(read_timeout=fuzz.READ_TIMEOUT_S)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda c: fuzz.send(httpd.server_port, c, random.Random(seed)),
                            cases))
    bad = [f"{c.kind}: {c.data[:80]!r} -> {why}" for c, g in zip(cases, got)
           if (why := fuzz.judge(c, g))]
    assert not bad, f"seed {seed}:\n" + "\n".join(bad)
    assert request(httpd.server_port, "/-/healthy")[0] == 200
