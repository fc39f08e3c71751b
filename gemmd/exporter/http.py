"""The HTTP side of the exporter: /metrics (gzip when asked), health endpoints, the runbook
the alerts link (/runbook), a landing page; optional TLS and basic auth from a Prometheus
exporter-toolkit web configuration file.

Anyone who can reach the port can talk to this server, so it is built to keep answering
Prometheus whatever other clients do:

- One asyncio event loop (a daemon thread) owns every socket. A connection costs a file
  descriptor and a small object while it waits for its request, never a thread; it gets
  ``read_timeout`` seconds in all for the TLS handshake and the request head, and
  ``write_timeout`` for the response. Every response closes its connection.
- At most ``max_connections`` connections are open (default: half the free file
  descriptors, at most 512). Beyond that the connection that has waited longest without
  sending a complete request is closed: a scrape, whose request arrives at once, is never
  the one dropped. Responses are made by a small thread pool; scrapes that arrive together
  share one render of the metrics (the exposition's cache), so Prometheus HA pairs,
  dashboards and a hundred scrapes at once are all served. At most ``max_inflight``
  (256) requests are being answered (made or written) at a time, any more get 503 at
  once: what bounds them is the memory of bodies written to slow readers.
- Requests are parsed by h11 (a kept, sans-IO HTTP/1.1 parser: Host required once in
  HTTP/1.1, strict Content-Length and line endings, ...); the request line is checked as
  soon as it arrives. Malformed requests get 400 (431, 413, 414, 501, 505 where those say
  more) and are closed; out of file descriptors, the accept loop pauses a second and says
  so once in the log instead of spinning.
- Basic auth: credentials verified once are answered from a cache (no bcrypt, no slot);
  the others wait for one bcrypt thread, where wrong passwords are limited per client
  address (429) and in the CPU they get, and logged once a minute (``_AuthGate``).
- ``/-/healthy`` and ``/-/ready`` are answered on the event loop without rendering metrics
  and without authentication (so that Kubernetes and Docker probes, which cannot easily send
  credentials, work; they disclose nothing but "up" and "ready"). ``/runbook`` (and
  ``/runbook.md``) neither: an operator opens it from an alert's runbook_url in a browser,
  and it is gemmd's own documentation, the same on every host.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import collections
import concurrent.futures
import errno
import hashlib
import hmac
import io
import ipaddress
import logging
import math
import os
import re
import resource
import socket
import ssl
import stat
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from email.utils import formatdate
from pathlib import Path
from typing import Any
from urllib.parse import unquote_to_bytes
from wsgiref.handlers import SimpleHandler
from wsgiref.headers import Headers

import h11
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.exposition import gzip_accepted

from gemmd.errors import ConfigError
from gemmd.exporter.exposition import Exposition

logger = logging.getLogger(__name__)

SERVER = "gemmd"  # the Server header: no version numbers for scanners
REALM = 'Basic realm="gemmd"'
HEALTH_PATHS = ("/-/healthy", "/-/ready")
RUNBOOK_PATHS = ("/runbook", "/runbook.md")
PUBLIC_PATHS = (*HEALTH_PATHS, *RUNBOOK_PATHS)  # answered without credentials
READ_TIMEOUT_S = 10.0  # TLS handshake + request head, in all
WRITE_TIMEOUT_S = 30.0  # the response (MBs uncompressed for 8 GPUs) to a slow reader
BACKLOG = 128
ACCEPT_RETRY_S = 1.0  # out of file descriptors: accept() again after this
WORKERS = 4
# Requests being answered at once (made by the workers or being written); more get 503.
# Scrapes that arrive together share one render of the state (Exposition's lock), so what
# one more costs is its live gauges and, while a slow reader takes it, its body's memory
# (1.7 MB uncompressed, 120 KB gzip for 8 GPUs x 100 probes): 256 serves Prometheus HA
# pairs, dashboards and storms of a hundred scrapes at once within ~450 MB at worst.
MAX_INFLIGHT = 256
MAX_HEAD = 16 << 10  # request line + headers
MAX_HEADERS = 100
MAX_BODY = 64 << 10  # a body is read (and ignored) so that closing does not reset the answer
TEXT = ("Content-Type", "text/plain; charset=utf-8")


# ----------------------------------------------------------------------- the web config

# Go's cipher suite names (crypto/tls, the secure ones exporter-toolkit accepts for TLS 1.2)
# to OpenSSL's. TLS 1.3 suites are not configurable in Go either.
GO_CIPHERS = {
    "TLS_ECDHE_ECDSA_WITH_AES_128_CBC_SHA": "ECDHE-ECDSA-AES128-SHA",
    "TLS_ECDHE_RSA_WITH_AES_128_CBC_SHA": "ECDHE-RSA-AES128-SHA",
    "TLS_ECDHE_ECDSA_WITH_AES_256_CBC_SHA": "ECDHE-ECDSA-AES256-SHA",
    "TLS_ECDHE_RSA_WITH_AES_256_CBC_SHA": "ECDHE-RSA-AES256-SHA",
    "TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256": "ECDHE-ECDSA-AES128-GCM-SHA256",
    "TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256": "ECDHE-RSA-AES128-GCM-SHA256",
    "TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384": "ECDHE-ECDSA-AES256-GCM-SHA384",
    "TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384": "ECDHE-RSA-AES256-GCM-SHA384",
    "TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256": "ECDHE-ECDSA-CHACHA20-POLY1305",
    "TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256": "ECDHE-RSA-CHACHA20-POLY1305",
}
TLS_VERSIONS = {"TLS10": ssl.TLSVersion.TLSv1, "TLS11": ssl.TLSVersion.TLSv1_1,
                "TLS12": ssl.TLSVersion.TLSv1_2, "TLS13": ssl.TLSVersion.TLSv1_3}
# client_auth_type -> (verify mode, needs client_ca_file). Python's ssl module can neither
# request a certificate without verifying it nor require one unverified: RequestClientCert
# (Go: asked for, never checked, never required) admits the same clients as NoClientCert,
# and RequireAnyClientCert is verified against client_ca_file, stricter than Go.
CLIENT_AUTH = {
    "NoClientCert": (ssl.CERT_NONE, False),
    "RequestClientCert": (ssl.CERT_NONE, False),
    "RequireAnyClientCert": (ssl.CERT_REQUIRED, True),
    "RequireClientCert": (ssl.CERT_REQUIRED, True),  # exporter-toolkit's old name for it
    "VerifyClientCertIfGiven": (ssl.CERT_OPTIONAL, True),
    "RequireAndVerifyClientCert": (ssl.CERT_REQUIRED, True),
}
# The headers exporter-toolkit lets a web config set, with their allowed values (if fixed).
EXTRA_HEADERS: dict[str, tuple[str, ...]] = {
    "Strict-Transport-Security": (), "X-Content-Type-Options": ("nosniff",),
    "X-Frame-Options": ("deny", "sameorigin"), "X-XSS-Protection": (),
    "Content-Security-Policy": ()}
_BCRYPT = re.compile(r"\$2[abxy]\$(\d\d)\$[./A-Za-z0-9]{53}")
# bcrypt's cost is a power of two: cost 10 takes ~60 ms a check on one core, 14 ~1 s, 31
# (which Go's bcrypt, and so exporter-toolkit, accepts) about 9 days. gemmd refuses hashes
# whose every check would take seconds: each scrape with a new password, and every wrong
# password an attacker sends, would cost that much.
MIN_BCRYPT_COST, MAX_BCRYPT_COST = 4, 14
_TLS_KEYS = ("cert_file", "key_file", "client_ca_file", "client_auth_type",
             "client_allowed_sans", "min_version", "max_version", "cipher_suites",
             "prefer_server_cipher_suites")
_UNSUPPORTED = {
    "tls_server_config.cert": "inline certificates are not supported: use cert_file",
    "tls_server_config.key": "inline keys are not supported: use key_file",
    "tls_server_config.client_ca": "inline CAs are not supported: use client_ca_file",
    "tls_server_config.curve_preferences": "not supported (Python's ssl module cannot set "
                                           "a curve preference list)",
    "rate_limit": "not supported by gemmd (it bounds connections and in-flight requests "
                  "itself)",
}


@dataclass(frozen=True)
class TLSSettings:
    """tls_server_config, with file names resolved against the web config's directory."""

    cert_file: str
    key_file: str
    client_ca_file: str | None = None
    client_auth_type: str = "NoClientCert"
    client_allowed_sans: tuple[str, ...] = ()
    min_version: str = "TLS12"
    max_version: str = "TLS13"
    cipher_suites: tuple[str, ...] = ()
    prefer_server_cipher_suites: bool = True

    def files(self) -> tuple[str, ...]:
        return (self.cert_file, self.key_file) + ((self.client_ca_file,)
                                                  if self.client_ca_file else ())

    def context(self) -> ssl.SSLContext:
        """A server-side SSLContext; raises OSError/ssl.SSLError for unreadable files."""
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = TLS_VERSIONS[self.min_version]
        ctx.maximum_version = TLS_VERSIONS[self.max_version]
        ctx.load_cert_chain(self.cert_file, self.key_file)
        verify, _ = CLIENT_AUTH[self.client_auth_type]
        if self.client_ca_file and verify != ssl.CERT_NONE:
            ctx.load_verify_locations(cafile=self.client_ca_file)
        ctx.verify_mode = verify
        if self.cipher_suites:
            ctx.set_ciphers(":".join(GO_CIPHERS[c] for c in self.cipher_suites))
        if self.prefer_server_cipher_suites:
            ctx.options |= ssl.OP_CIPHER_SERVER_PREFERENCE
        else:
            ctx.options &= ~ssl.OP_CIPHER_SERVER_PREFERENCE
        ctx.set_alpn_protocols(["http/1.1"])  # HTTP/1.1 only: h2 clients fall back
        return ctx


@dataclass(frozen=True)
class WebConfig:
    """An exporter-toolkit web configuration file (``load_web_config``)."""

    source: str = "<none>"
    tls: TLSSettings | None = None
    users: Mapping[str, str] = field(default_factory=dict)  # user -> bcrypt hash
    headers: tuple[tuple[str, str], ...] = ()
    http2: bool = True  # accepted for compatibility; gemmd speaks HTTP/1.1 only


def load_web_config(path: str | os.PathLike[str]) -> WebConfig:
    """Read and validate an exporter-toolkit web configuration file (the format of
    node_exporter's and dcgm-exporter's ``--web.config.file``). Every problem is reported
    in one ConfigError, one line each, naming the key: missing or unreadable certificate,
    key or CA files, a certificate that does not match its key, unknown client_auth_type,
    TLS versions or cipher suites, password hashes that are not bcrypt, headers
    exporter-toolkit does not allow, unknown keys."""
    from gemmd.config import read_file, read_yaml  # the hardened reader of gemmd.yaml

    source, text = read_file(os.fspath(path))
    data, _ = read_yaml(text, source)
    base = Path(source).resolve().parent
    problems: list[str] = []
    if data is None:
        return WebConfig(source)
    if not isinstance(data, dict):
        raise ConfigError(source, [f"<top>: expected a mapping, got {type(data).__name__}"])
    for key in data:
        if key in _UNSUPPORTED:
            problems.append(f"{key}: {_UNSUPPORTED[key]}")
        elif key not in ("tls_server_config", "http_server_config", "basic_auth_users"):
            problems.append(f"{key}: unknown key (expected tls_server_config, "
                            "http_server_config or basic_auth_users)")
    tls = _tls_settings(_section(data, "tls_server_config", problems), base, problems)
    http = _section(data, "http_server_config", problems)
    for key in http:
        if key not in ("http2", "headers"):
            problems.append(f"http_server_config.{key}: unknown key (expected http2 or "
                            "headers)")
    http2 = http.get("http2", True)
    if not isinstance(http2, bool):
        problems.append(f"http_server_config.http2: expected true or false, got {http2!r}")
    headers = _headers(_section(http, "headers", problems, "http_server_config."), problems)
    users = _users(_section(data, "basic_auth_users", problems), problems)
    if problems:
        raise ConfigError(source, problems)
    return WebConfig(source, tls, users, headers, http2)


def _section(data: dict, key: str, problems: list[str], prefix: str = "") -> dict:
    value = data.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        problems.append(f"{prefix}{key}: expected a mapping, got {type(value).__name__}")
        return {}
    return value


def _strings(value: Any, key: str, problems: list[str]) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        problems.append(f"{key}: expected a list of strings")
        return ()
    return tuple(value)


def _tls_settings(tls: dict, base: Path, problems: list[str]) -> TLSSettings | None:
    if not tls:
        return None
    n0, k = len(problems), "tls_server_config."
    for key in tls:
        if k + key in _UNSUPPORTED:
            problems.append(f"{k}{key}: {_UNSUPPORTED[k + key]}")
        elif key not in _TLS_KEYS:
            problems.append(f"{k}{key}: unknown key")
    files: dict[str, str | None] = {}
    for key in ("cert_file", "key_file", "client_ca_file"):
        v = tls.get(key)
        if v is None or v == "":
            if key != "client_ca_file":
                problems.append(f"{k}{key}: missing (required for TLS)")
            files[key] = None
        elif not isinstance(v, str):
            problems.append(f"{k}{key}: expected a file name, got {type(v).__name__}")
            files[key] = None
        else:
            name = files[key] = str(base / v)
            problem = unreadable(name)
            if problem:
                problems.append(f"{k}{key}: cannot read {name}: {problem}")
                files[key] = None
    auth = tls.get("client_auth_type", "NoClientCert") or "NoClientCert"
    if auth not in CLIENT_AUTH:
        problems.append(f"{k}client_auth_type: {auth!r} is not one of "
                        + ", ".join(c for c in CLIENT_AUTH if c != "RequireClientCert"))
    else:
        verify, needs_ca = CLIENT_AUTH[auth]
        if needs_ca and not tls.get("client_ca_file"):
            problems.append(f"{k}client_ca_file: required with client_auth_type {auth}")
        if tls.get("client_ca_file") and auth == "NoClientCert":
            problems.append(f"{k}client_ca_file: given without a client_auth_type that "
                            "checks client certificates (use RequireAndVerifyClientCert)")
    sans = _strings(tls.get("client_allowed_sans"), k + "client_allowed_sans", problems)
    if sans and auth not in ("RequireAnyClientCert", "RequireClientCert",
                             "RequireAndVerifyClientCert"):
        problems.append(f"{k}client_allowed_sans: requires client_auth_type "
                        "RequireAnyClientCert or RequireAndVerifyClientCert")
    versions = []
    for key, default in (("min_version", "TLS12"), ("max_version", "TLS13")):
        v = tls.get(key, default)
        if v not in TLS_VERSIONS:
            problems.append(f"{k}{key}: {v!r} is not one of {', '.join(TLS_VERSIONS)}")
        versions.append(v)
    if all(v in TLS_VERSIONS for v in versions) and \
            TLS_VERSIONS[versions[0]] > TLS_VERSIONS[versions[1]]:
        problems.append(f"{k}min_version: {versions[0]} is above max_version {versions[1]}")
    ciphers = _strings(tls.get("cipher_suites"), k + "cipher_suites", problems)
    for c in ciphers:
        if c not in GO_CIPHERS:
            problems.append(f"{k}cipher_suites: unknown or insecure cipher suite {c!r} "
                            f"(known: {', '.join(GO_CIPHERS)})")
    prefer = tls.get("prefer_server_cipher_suites", True)
    if not isinstance(prefer, bool):
        problems.append(f"{k}prefer_server_cipher_suites: expected true or false")
    cert, key_file = files["cert_file"], files["key_file"]
    if len(problems) > n0 or cert is None or key_file is None:  # None: a problem said so
        return None
    settings = TLSSettings(cert, key_file, files["client_ca_file"], auth, sans, versions[0],
                           versions[1], ciphers, prefer)
    try:  # the certificate matches its key, the CA file holds certificates, ...
        settings.context()
    except (OSError, ssl.SSLError, ValueError) as e:
        problems.append(f"{k}cert_file/key_file/client_ca_file: cannot load them: "
                        f"{_ssl_reason(e)}")
        return None
    return settings


def unreadable(name: str) -> str | None:
    """Why the file ``name`` cannot be read as a certificate or key (None: it can). Only
    regular files: OpenSSL's open() of a FIFO waits for a writer forever, and a device
    never ends."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO's open() waits otherwise
    except (OSError, ValueError) as e:  # ValueError: a NUL in the name
        return str(getattr(e, "strerror", None) or e)
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            return os.strerror(errno.EISDIR)
        if not stat.S_ISREG(mode):
            return "not a regular file" + (" (a named pipe)" if stat.S_ISFIFO(mode) else "")
        os.read(fd, 1)
    except OSError as e:
        return str(e.strerror or e)
    finally:
        os.close(fd)
    return None


def _ssl_reason(e: Exception) -> str:
    if isinstance(e, ssl.SSLError) and e.reason:
        return f"{e.library or 'SSL'}: {e.reason}"
    return getattr(e, "strerror", None) or str(e)


def _headers(headers: dict, problems: list[str]) -> tuple[tuple[str, str], ...]:
    out = []
    for name, value in headers.items():
        key = f"http_server_config.headers.{name}"
        if name not in EXTRA_HEADERS:
            problems.append(f"{key}: this header cannot be configured (allowed: "
                            f"{', '.join(EXTRA_HEADERS)})")
        elif not isinstance(value, str) or "\r" in value or "\n" in value:
            problems.append(f"{key}: expected a one-line string")
        elif EXTRA_HEADERS[name] and value not in EXTRA_HEADERS[name]:
            problems.append(f"{key}: {value!r} is not one of {', '.join(EXTRA_HEADERS[name])}")
        elif value:  # blank: unset
            out.append((name, value))
    return tuple(out)


def _users(users: dict, problems: list[str]) -> dict[str, str]:
    out = {}
    for user, hashed in users.items():
        key = f"basic_auth_users.{user}"
        if not isinstance(user, str) or not user or ":" in user:
            problems.append(f"{key}: a user name is a non-empty string without ':'")
        elif not isinstance(hashed, str) or not (m := _BCRYPT.fullmatch(hashed)):
            # The value is a secret: never quoted.
            problems.append(f"{key}: not a bcrypt hash ($2a$, $2b$ or $2y$, cost "
                            f"{MIN_BCRYPT_COST:02d}-{MAX_BCRYPT_COST}, 60 characters; make one "
                            "with htpasswd -nBC 10 \"\" | tr -d ':\\n')")
        elif not MIN_BCRYPT_COST <= int(m.group(1)) <= MAX_BCRYPT_COST:
            cost = int(m.group(1))
            took = 0.06 * 2.0 ** (cost - 10)
            problems.append(f"{key}: bcrypt cost {cost} is outside {MIN_BCRYPT_COST:02d}-"
                            f"{MAX_BCRYPT_COST}" + (f" (each check would take about "
                                                    f"{_duration(took)} of CPU)" if
                                                    cost > MAX_BCRYPT_COST else "")
                            + "; make one with htpasswd -nBC 10 \"\" | tr -d ':\\n'")
        else:
            out[user] = hashed
    if out:
        try:
            import bcrypt  # noqa: F401
        except ImportError:
            problems.append("basic_auth_users: needs the Python package bcrypt "
                            "(pip install bcrypt)")
    return out


def _duration(s: float) -> str:
    for unit, n in (("days", 86400), ("hours", 3600), ("minutes", 60)):
        if s >= 2 * n:
            return f"{s / n:.0f} {unit}"
    return f"{s:.1f} s" if s < 10 else f"{s:.0f} s"


# --------------------------------------------------------------------------- basic auth

class BasicAuth:
    """Checks ``Authorization: Basic`` against bcrypt hashes. bcrypt is slow on purpose
    (~60 ms at cost 10), so a verified password is remembered per user as a keyed HMAC
    and compared in constant time: a scrape after the first costs microseconds
    (``cached``), and needs no bcrypt. Recently refused credentials are remembered too
    (bounded), so replaying one wrong password is cheap. An unknown user costs the same
    bcrypt time as a known one (it is checked against a real user's hash and refused), so
    user names cannot be found by timing. Who gets a bcrypt check, and when, is the
    server's ``_AuthGate``'s business; ``check`` (cached, else bcrypt) is for callers
    without one."""

    MAX_REFUSED = 1024

    def __init__(self, users: Mapping[str, str]):
        import bcrypt

        self._checkpw = bcrypt.checkpw
        self._users = {u.encode(): h.encode() for u, h in users.items()}
        # The costliest hash stands in for unknown users: the same time, no hashing now
        # (hashing a decoy at start took the cost's time on the main thread, deaf to
        # SIGTERM).
        self._decoy = max(self._users.values(), key=lambda h: h[4:6], default=b"")
        self._key = os.urandom(32)
        self._verified: dict[bytes, bytes] = {}
        self._refused: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._serial = threading.Lock()

    def _tag(self, user: bytes, password: bytes) -> bytes:
        return hmac.new(self._key, user + b"\0" + password, hashlib.sha256).digest()

    def cached(self, authorization: str | None) -> bool | None:
        """True: verified before; False: no credentials, malformed, or refused before;
        None: only bcrypt can tell (``verify``). Microseconds."""
        creds = _basic_credentials(authorization)
        if creds is None:
            return False
        tag = self._tag(*creds)
        known = self._verified.get(creds[0])
        if known is not None and hmac.compare_digest(known, tag):
            return True
        if tag in self._refused:
            return False
        return None

    def verify(self, authorization: str | None) -> bool:
        """bcrypt's verdict on the credentials (slow), remembered either way."""
        creds = _basic_credentials(authorization)
        if creds is None:
            return False
        user, password = creds
        hashed = self._users.get(user)
        try:
            ok = self._checkpw(password, hashed or self._decoy) and hashed is not None
        except ValueError:  # e.g. bcrypt >= 5 refuses passwords over 72 bytes
            ok = False
        tag = self._tag(user, password)
        with self._lock:
            if ok:
                self._verified[user] = tag
            else:
                self._refused[tag] = None
                if len(self._refused) > self.MAX_REFUSED:
                    self._refused.popitem(last=False)
        return ok

    def check(self, authorization: str | None) -> bool:
        verdict = self.cached(authorization)
        if verdict is not None:
            return verdict
        with self._serial:  # without a gate: one bcrypt at a time
            return self.verify(authorization)


class _AuthGate:
    """Who gets a bcrypt check of credentials the cache cannot answer, and when; on the
    server's event loop, except the checks themselves, which one thread runs.

    A good credential never waits behind bad ones: once verified it is answered from the
    cache, on the event loop, without a check; wrong credentials never hold a worker or an
    in-flight slot. Checks that fail are what an attacker can send without limit, so:

    - per client address, ``FAIL_BURST`` failures, then one per ``FAIL_EVERY_S`` (a token
      bucket); a client without tokens, or with as many checks waiting as it has tokens,
      gets 429 with Retry-After at once, no bcrypt;
    - checks run on one thread (at most one core), clients that passed a check before
      first, then the first check of clients without failures, then the others; after a
      failed check, the next check of a client that has not passed one waits as long
      again, so failures get at most ``FAIL_SHARE`` of that core;
    - at most ``MAX_WAITING`` checks wait; a better-placed one evicts the worst (503);
    - failures are logged once per ``LOG_EVERY_S``, counted: who, how many, how many 429.
    """

    FAIL_BURST = 5
    FAIL_EVERY_S = 2.0
    FAIL_SHARE = 0.5
    MAX_WAITING = 16
    MAX_CLIENTS = 4096  # addresses remembered (least recently seen forgotten first)
    LOG_EVERY_S = 60.0

    def __init__(self, auth: BasicAuth, loop: asyncio.AbstractEventLoop,
                 clock: Callable[[], float] = time.monotonic):
        self.auth, self.loop, self.clock = auth, loop, clock
        # address -> [tokens, when counted, checks waiting]
        self.clients: collections.OrderedDict[str, list[float]] = collections.OrderedDict()
        self.good: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.waiting: list[tuple[int, int, str, str | None, Callable[[bool | None], None]]] \
            = []
        self._seq = 0
        self._cool_until = 0.0  # checks of clients not known good wait until then
        self._cv = threading.Condition()
        self._stopped = False
        self._failed = self._limited = 0  # since the last log line
        self._failed_from: set[str] = set()
        self._last_log = -math.inf
        self._thread = threading.Thread(target=self._work, name="gemmd-http-auth",
                                        daemon=True)
        self._thread.start()

    # -- on the event loop
    def _client(self, addr: str) -> list[float]:
        now = self.clock()
        c = self.clients.get(addr)
        if c is None:
            c = self.clients[addr] = [float(self.FAIL_BURST), now, 0.0]
            if len(self.clients) > self.MAX_CLIENTS:
                self.clients.popitem(last=False)
        else:
            self.clients.move_to_end(addr)
            c[0] = min(float(self.FAIL_BURST), c[0] + (now - c[1]) / self.FAIL_EVERY_S)
            c[1] = now
        return c

    def submit(self, addr: str, authorization: str | None,
               done: Callable[[bool | None], None]) -> str | None:
        """Queue a bcrypt check; ``done(ok)`` runs on the loop later (None: evicted, answer
        503). Or refuse at once: the status to answer (429 or 503)."""
        c = self._client(addr)
        if c[0] - c[2] < 1.0:
            self._limited += 1
            self._note_failures()
            return "429 Too Many Requests"
        # Known good first; then an address's first check while it has no failures and
        # nothing waiting (Prometheus after a restart); then everything else.
        rank = 0 if addr in self.good else (1 if c[0] >= self.FAIL_BURST and not c[2] else 2)
        with self._cv:
            if len(self.waiting) >= self.MAX_WAITING:
                worst = max(self.waiting)
                if worst[0] <= rank:
                    return "503 Service Unavailable"
                self.waiting.remove(worst)
                self.loop.call_soon(self._finish, worst[2], worst[4], None)
            self._seq += 1
            self.waiting.append((rank, self._seq, addr, authorization, done))
            c[2] += 1
            self._cv.notify()
        return None

    def _finish(self, addr: str, done: Callable[[bool | None], None], ok: bool | None
                ) -> None:
        c = self._client(addr)
        c[2] = max(0.0, c[2] - 1)
        if ok:
            self.good[addr] = None
            self.good.move_to_end(addr)
            if len(self.good) > self.MAX_CLIENTS:
                self.good.popitem(last=False)
        elif ok is not None:
            c[0] = max(0.0, c[0] - 1.0)
            self.refused(addr)
        done(ok)

    def refused(self, addr: str) -> None:
        """A failed attempt (also one answered from the cache): counted for the log."""
        self._failed += 1
        if len(self._failed_from) < self.MAX_CLIENTS:
            self._failed_from.add(addr)
        self._note_failures()

    def _note_failures(self) -> None:
        now = self.clock()
        if not self._failed or now - self._last_log < self.LOG_EVERY_S:
            return
        self._last_log = now
        logger.warning("http: %d failed basic-auth attempt(s) from %d address(es)%s "
                       "(logged at most once a minute)", self._failed,
                       len(self._failed_from),
                       f"; {self._limited} answered 429 (too many failures from one "
                       f"address: {self.FAIL_BURST}, then one per {self.FAIL_EVERY_S:g} s)"
                       if self._limited else "")
        self._failed = self._limited = 0
        self._failed_from.clear()

    def retry_after(self, addr: str) -> int:
        c = self.clients.get(addr)
        if c is None:
            return 1
        return max(1, math.ceil((1.0 - (c[0] - c[2])) * self.FAIL_EVERY_S))

    # -- the checking thread
    def _next(self) -> tuple[int, int, str, str | None, Callable[[bool | None], None]] | None:
        with self._cv:
            while not self._stopped:
                if self.waiting:
                    best = min(self.waiting)
                    wait = self._cool_until - time.monotonic() if best[0] else 0.0
                    if wait <= 0:
                        self.waiting.remove(best)
                        return best
                    self._cv.wait(wait)
                else:
                    self._cv.wait()
            return None

    def _work(self) -> None:
        while (job := self._next()) is not None:
            _, _, addr, authorization, done = job
            t = time.monotonic()
            try:
                ok = self.auth.verify(authorization)
            except Exception as e:  # noqa: BLE001 - a refusal, never a dead thread
                logger.error("http: basic-auth check failed: %s", e)
                ok = False
            if not ok:
                took = time.monotonic() - t
                with self._cv:
                    self._cool_until = time.monotonic() + took * (1 / self.FAIL_SHARE - 1)
            try:
                self.loop.call_soon_threadsafe(self._finish, addr, done, ok)
            except RuntimeError:  # the loop is closed: the server stopped
                return

    def stop(self) -> None:
        with self._cv:
            self._stopped = True
            self.waiting.clear()
            self._cv.notify_all()


def _basic_credentials(header: str | None) -> tuple[bytes, bytes] | None:
    if not header:
        return None
    scheme, _, token = header.strip().partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        user, sep, password = base64.b64decode(token.strip(), validate=True).partition(b":")
    except (binascii.Error, ValueError):
        return None
    return (user, password) if sep else None


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


class _Connection(asyncio.Protocol):
    """One client connection: (TLS handshake,) one request parsed by h11, one response,
    close. gemmd keeps the connection management: timeouts, limits, the answers to bad
    requests."""

    def __init__(self, server: _Server, sock: socket.socket):
        self.srv = server
        self.loop = server.loop
        self.sock = sock  # until the transport exists, aborting means shutting this down
        self.transport: Any = None
        self.parser = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD)
        self.started = False  # a byte other than the empty lines before a request came
        self.first = bytearray()  # the request line until its LF has arrived
        self.line_checked = False
        self.received = 0  # bytes of the head so far (empty lines before it included)
        # (method, path, query, version, headers) once the request head is read
        self.head: tuple[str, str, str, str, dict[str, str]] | None = None
        self.body = 0  # bytes of body read (and ignored)
        self.done = False  # the whole request is in: what follows is ignored
        self.timer: asyncio.TimerHandle | None = None
        self.job: asyncio.Future | None = None
        self.counted = False  # holds an in-flight slot
        self.closed = False
        self.tls = False

    # -- life cycle
    async def attach(self, ctx: ssl.SSLContext | None) -> None:
        """Give the accepted socket to asyncio (with the TLS handshake, if any); the read
        timer started at accept() covers the handshake."""
        try:
            await self.loop.connect_accepted_socket(
                lambda: self, self.sock, ssl=ctx,
                ssl_handshake_timeout=self.srv.read_timeout if ctx else None)
        except (OSError, ssl.SSLError, EOFError, asyncio.TimeoutError, ConnectionError,
                RuntimeError, ValueError) as e:
            logger.debug("http: %s from %s failed: %s", "TLS handshake" if ctx else "setup",
                         self.peer(), e)
            self.sock.close()  # the transport's socket: closing twice is harmless
            self.connection_lost(None)

    def connection_made(self, transport) -> None:
        self.transport = transport
        tls = self.srv.tls
        self.tls = tls is not None
        if self.closed:  # timed out or evicted while the handshake finished
            transport.abort()
        elif tls is not None and not tls.sans_allowed(transport.get_extra_info("peercert")):
            logger.info("http: client certificate of %s has none of client_allowed_sans",
                        self.peer())
            transport.abort()

    def connection_lost(self, exc) -> None:
        if self.closed:
            return
        self.closed = True
        if self.timer is not None:
            self.timer.cancel()
        self.srv.closed(self)
        if self.counted and (self.job is None or self.job.done()):
            self.srv.release(self)

    def eof_received(self) -> bool:
        # A half-close after a complete request still gets its answer, one in the middle
        # of a request a 400 (not over TLS: a TLS transport cannot write after EOF).
        if self.tls:
            return False
        if not self.done and self.received:
            self.done = True
            self.srv.waiting.pop(self, None)
            self.reply(_canned(_STATUS[400], self.srv.extra))
        return self.done  # False: closed at once (nothing was asked)

    def timed_out(self) -> None:
        if self.closed:
            return
        if not self.done and self.received and self.transport is not None:
            self.reply(_canned("408 Request Timeout", self.srv.extra))
        else:
            self.abort()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()
            return
        try:  # mid-handshake: the handshake fails at once and asyncio closes the socket
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def peer(self) -> str:
        try:
            p = self.sock.getpeername()
        except OSError:
            return "?"
        return f"{p[0]}:{p[1]}"

    def address(self) -> str:
        """The client's address, the unit of rate limits."""
        peer = self.transport.get_extra_info("peername") if self.transport else None
        return str(peer[0]) if peer else "?"

    # -- reading the request
    def data_received(self, data: bytes) -> None:
        if self.done:
            return  # after the request: ignored (the connection closes after the answer)
        try:
            self.parse(data)
        except (_BadRequest, h11.RemoteProtocolError) as e:
            status = e.status if isinstance(e, _BadRequest) else \
                _STATUS.get(e.error_status_hint, _STATUS[400])
            logger.debug("http: %s from %s: %s", status, self.peer(), e)
            self.done = True
            self.srv.waiting.pop(self, None)
            self.reply(_canned(status, self.srv.extra))

    def parse(self, data: bytes) -> None:
        if not self.started:  # empty lines before the request line are allowed (RFC 9112 2.2)
            self.received += len(data)
            data = data.lstrip(b"\r\n")
            if not data:
                if self.received > MAX_HEAD:
                    raise _BadRequest(_STATUS[400], "only empty lines")
                return
            self.started = True
            if not _TOKEN_START.match(data):  # TLS to the plain port, a binary protocol
                raise _BadRequest(_STATUS[400], "not an HTTP request")
        else:
            self.received += len(data)
        if not self.line_checked:
            self.first += data[:MAX_HEAD + 1 - len(self.first)]
            eol = self.first.find(b"\n")
            if eol < 0:
                if len(self.first) > MAX_HEAD:
                    raise _BadRequest(_STATUS[414])
            else:
                if eol > MAX_HEAD:
                    raise _BadRequest(_STATUS[414])
                _check_request_line(bytes(self.first[:eol]))  # garbage is answered at once
                self.line_checked = True
                self.first.clear()
        self.parser.receive_data(data)
        while not self.done:
            event = self.parser.next_event()
            if event is h11.NEED_DATA:
                return
            if isinstance(event, h11.Request):
                self.request(event)
            elif isinstance(event, h11.Data):
                self.body += len(event.data)
                if self.body > MAX_BODY:
                    raise _BadRequest(_STATUS[413])
            elif isinstance(event, h11.EndOfMessage):
                self.done = True
                self.srv.dispatch(self)
            else:  # ConnectionClosed, PAUSED: nothing more to read
                return

    def request(self, req: h11.Request) -> None:
        # h11 bounds only a head that arrives in pieces; one that came whole is bounded here
        if self.received - len(self.parser.trailing_data[0]) > MAX_HEAD:
            raise _BadRequest(_STATUS[431])
        if not req.http_version.startswith(b"1."):  # h11 takes any d.d
            raise _BadRequest(_STATUS[505])
        if len(req.headers) > MAX_HEADERS:
            raise _BadRequest(_STATUS[431])
        headers: dict[str, str] = {}
        for name, value in req.headers:
            key, v = name.decode("ascii"), value.decode("latin-1")
            headers[key] = f"{headers[key]}, {v}" if key in headers else v
        if "transfer-encoding" in headers:
            raise _BadRequest(_STATUS[501], "Transfer-Encoding is not supported")
        length = headers.get("content-length", "0")  # h11: digits, one value
        if len(length) > 18 or int(length) > MAX_BODY:
            raise _BadRequest(_STATUS[413])
        path, query = _target(req.target)
        self.head = (req.method.decode("ascii"), path, query,
                     "HTTP/" + req.http_version.decode("ascii"), headers)

    # -- answering
    def environ(self) -> dict:
        assert self.head is not None  # dispatch() comes after the head was read
        method, path, query, version, headers = self.head
        peer = self.transport.get_extra_info("peername") or ("", 0)
        env = {"REQUEST_METHOD": method, "SCRIPT_NAME": "", "PATH_INFO": path,
               "QUERY_STRING": query, "SERVER_PROTOCOL": version,
               "SERVER_NAME": self.srv.server_address[0],
               "SERVER_PORT": str(self.srv.server_port), "REMOTE_ADDR": str(peer[0]),
               "REMOTE_PORT": str(peer[1]), "HTTPS": "on" if self.tls else "off",
               "CONTENT_LENGTH": headers.get("content-length", ""),
               "CONTENT_TYPE": headers.get("content-type", "")}
        for k, v in headers.items():
            if k not in ("content-length", "content-type"):
                env["HTTP_" + k.upper().replace("-", "_")] = v
        return env

    def rendered(self, job: asyncio.Future) -> None:
        if self.closed or job.cancelled():
            if self.counted:
                self.srv.release(self)
            return
        try:
            data = job.result()
        except Exception as e:  # noqa: BLE001 - the gateway answers 500 itself; this is a bug
            logger.error("http: rendering failed: %s", e)
            data = _canned("500 Internal Server Error", self.srv.extra)
        self.reply(data)

    def reply(self, data: bytes) -> None:
        if self.closed or self.transport is None:
            return
        if self.timer is not None:
            self.timer.cancel()
        self.transport.write(data)
        self.transport.close()  # after the buffer is written
        self.timer = self.loop.call_later(self.srv.write_timeout, self.abort)


class _TLS:
    """The server's SSLContext, rebuilt when the certificate, key or CA file changes (as
    exporter-toolkit reloads them); checked at most once a second, on the event loop."""

    def __init__(self, settings: TLSSettings):
        self.settings = settings
        self._ctx = settings.context()
        self._sig = self._signature()
        self._checked = time.monotonic()
        self._failed: tuple | None = None
        self._sans = {self._norm(s) for s in settings.client_allowed_sans}

    def _signature(self) -> tuple:
        out: list[tuple[int, int, int] | None] = []  # None: the file cannot be read
        for f in self.settings.files():
            try:
                st = os.stat(f)
                out.append((st.st_ino, st.st_size, st.st_mtime_ns))
            except OSError:
                out.append(None)
        return tuple(out)

    def context(self) -> ssl.SSLContext:
        now = time.monotonic()
        if now - self._checked >= 1.0:
            self._checked = now
            sig = self._signature()
            if sig != self._sig and sig != self._failed:
                try:
                    for f in self.settings.files():  # a FIFO put there would block the loop
                        if (problem := unreadable(f)) is not None:
                            raise OSError(f"{f}: {problem}")
                    self._ctx, self._sig, self._failed = self.settings.context(), sig, None
                    logger.info("http: TLS certificate files changed: reloaded")
                except (OSError, ssl.SSLError, ValueError) as e:
                    self._failed = sig
                    logger.error("http: TLS certificate files changed but cannot be loaded "
                                 "(%s); still using the previous ones", _ssl_reason(e))
        return self._ctx

    @staticmethod
    def _norm(value: str) -> str:
        try:
            return ipaddress.ip_address(value.strip()).compressed
        except ValueError:
            return value.strip()

    def sans_allowed(self, cert: dict | None) -> bool:
        if not self._sans:
            return True
        names = [v for _, v in (cert or {}).get("subjectAltName", ())]
        return any(self._norm(v) in self._sans for v in names)


class _Server:
    """The listening socket and its event loop thread; ``shutdown()``, ``server_close()``,
    ``server_port`` and ``server_address`` as socketserver's servers have them."""

    def __init__(self, wsgi: Callable, sock: socket.socket, *, tls: _TLS | None,
                 extra: list[tuple[str, str]], read_timeout: float, write_timeout: float,
                 max_connections: int, max_inflight: int, workers: int,
                 auth: BasicAuth | None = None):
        self.wsgi, self.socket, self.tls, self.extra = wsgi, sock, tls, extra
        self.scheme = "https" if tls is not None else "http"  # what is served, for the log
        self.server_address = sock.getsockname()
        self.server_port = self.server_address[1]
        self.read_timeout, self.write_timeout = read_timeout, write_timeout
        self.max_connections, self.max_inflight = max_connections, max_inflight
        self.conns: dict[_Connection, None] = {}
        self.waiting: dict[_Connection, None] = {}  # no complete request yet, oldest first
        self.inflight = 0  # requests handed to the worker threads, until written
        self.tasks: set[asyncio.Future] = set()  # handshakes and renders under way
        self.pool = concurrent.futures.ThreadPoolExecutor(workers, "gemmd-http")
        self._noted: dict[str, float] = {}
        self._accept_failing = False
        self._stopped = False
        self.loop = asyncio.new_event_loop()
        self.loop.set_exception_handler(self._loop_error)
        self.gate = _AuthGate(auth, self.loop) if auth is not None else None
        self.loop.add_reader(sock.fileno(), self._accept)
        self._thread = threading.Thread(target=self.loop.run_forever, name="gemmd-http",
                                        daemon=True)
        self._thread.start()

    # -- accepting (event loop thread)
    def _accept(self) -> None:
        for _ in range(BACKLOG):
            try:
                sock, _ = self.socket.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    # Out of descriptors (or memory): stop accepting for a second instead
                    # of spinning on a listening socket that stays readable.
                    self.loop.remove_reader(self.socket.fileno())
                    self.loop.call_later(ACCEPT_RETRY_S, self._resume_accepting)
                    if not self._accept_failing:
                        self._accept_failing = True
                        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
                        self.note("emfile", "http: cannot accept connections: %s (open-file "
                                  "limit %d, %d connections open); retrying every second", e,
                                  soft, len(self.conns))
                    return
                if e.errno in (errno.ECONNABORTED, errno.EPROTO, errno.EPERM):
                    continue  # that client is gone (or a firewall said no); next one
                self.note("accept", "http: accept() failed: %s", e)
                return
            if self._accept_failing:
                self._accept_failing = False
                self.note("emfile-over", "http: accepting connections again")
            sock.setblocking(False)
            conn = _Connection(self, sock)
            if self.opened(conn):
                ctx = self.tls.context() if self.tls is not None else None
                self.track(self.loop.create_task(conn.attach(ctx)))

    def _resume_accepting(self) -> None:
        if not self._stopped and self.socket.fileno() >= 0:
            self.loop.add_reader(self.socket.fileno(), self._accept)

    # -- bookkeeping (event loop thread)
    def opened(self, conn: _Connection) -> bool:
        """Register a new connection; False if it was turned away at once."""
        self.conns[conn] = None
        self.waiting[conn] = None
        conn.timer = self.loop.call_later(self.read_timeout, conn.timed_out)
        if len(self.conns) > self.max_connections:
            oldest = next(iter(self.waiting))  # conn itself at worst
            self.note("full", "http: %d connections open (the limit): closing the ones "
                      "waiting longest for a request", len(self.conns))
            if oldest is conn:  # every other one is being answered
                if self.tls is None:
                    try:
                        conn.sock.send(_canned("503 Service Unavailable",
                                               [("Retry-After", "1"), *self.extra]))
                    except OSError:
                        pass
                conn.sock.close()
                conn.connection_lost(None)
                return False
            oldest.abort()
            oldest.connection_lost(None)  # free the slot now, not on the next turn
        return True

    def closed(self, conn: _Connection) -> None:
        self.conns.pop(conn, None)
        self.waiting.pop(conn, None)

    def release(self, conn: _Connection) -> None:
        if conn.counted:
            conn.counted = False
            self.inflight -= 1

    # -- answering (event loop thread)
    def dispatch(self, conn: _Connection) -> None:
        """A whole request is in: answer it. Health endpoints, other methods and refused
        credentials are answered here; the rest by the worker threads (``render``).
        Credentials the cache cannot answer wait for the auth gate's bcrypt thread, never
        for a worker or an in-flight slot."""
        self.waiting.pop(conn, None)
        if conn.timer is not None:
            conn.timer.cancel()
        # Reading goes on (what follows the request is discarded): a paused TLS transport
        # would never see the client's close_notify and linger until write_timeout.
        env = conn.environ()
        path = env["PATH_INFO"]
        if path in HEALTH_PATHS or env["REQUEST_METHOD"] not in ("GET", "HEAD"):
            conn.reply(_run_wsgi(self.wsgi, env))  # cheap: answered here, never queued
            return
        if self.gate is not None and path not in RUNBOOK_PATHS:
            header = env.get("HTTP_AUTHORIZATION")
            verdict = self.gate.auth.cached(header)
            if verdict is None:
                self._verify(conn, env, header)
                return
            if not verdict:
                if header:
                    self.gate.refused(conn.address())
                env["gemmd.auth"] = "refused"
                conn.reply(_run_wsgi(self.wsgi, env))
                return
            env["gemmd.auth"] = "ok"
        self.render(conn, env)

    def _verify(self, conn: _Connection, env: dict, header: str | None) -> None:
        assert self.gate is not None
        addr = conn.address()

        def done(ok: bool | None) -> None:
            if conn.closed:
                return
            if ok is None:
                self.note("auth-busy", "http: too many basic-auth checks waiting: answering "
                          "503")
                conn.reply(_canned("503 Service Unavailable",
                                   [("Retry-After", "1"), *self.extra]))
                return
            env["gemmd.auth"] = "ok" if ok else "refused"
            if ok:
                self.render(conn, env)
            else:
                conn.reply(_run_wsgi(self.wsgi, env))

        refusal = self.gate.submit(addr, header, done)
        if refusal is not None:
            retry = self.gate.retry_after(addr) if refusal.startswith("429") else 1
            conn.reply(_canned(refusal, [("Retry-After", str(retry)), *self.extra]))

    def render(self, conn: _Connection, env: dict) -> None:
        """Hand the request to a worker thread; 503 at once while ``max_inflight``
        responses are being made or written."""
        if self.inflight >= self.max_inflight:
            self.note("busy", "http: %d requests in flight (the limit): answering 503",
                      self.inflight)
            conn.reply(_canned("503 Service Unavailable", [("Retry-After", "1"), *self.extra]))
            return
        self.inflight += 1
        conn.counted = True
        conn.job = self.loop.run_in_executor(self.pool, _run_wsgi, self.wsgi, env)
        conn.job.add_done_callback(conn.rendered)
        self.track(conn.job)

    def track(self, task: asyncio.Future) -> None:
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def note(self, what: str, msg: str, *args: Any) -> None:
        """A warning at most once a minute per kind: an attack must not flood the log."""
        now = time.monotonic()
        if now - self._noted.get(what, -1e9) >= 60:
            self._noted[what] = now
            logger.warning(msg, *args)

    def _loop_error(self, loop: asyncio.AbstractEventLoop, context: dict) -> None:
        self.note("loop", "http: %s: %s", context.get("message"), context.get("exception"))

    # -- stopping (any thread)
    async def _stop(self) -> None:
        self.loop.remove_reader(self.socket.fileno())
        if self.gate is not None:
            self.gate.stop()
        for conn in list(self.conns):
            conn.abort()
            conn.connection_lost(None)
        for task in list(self.tasks):
            task.cancel()
        await asyncio.sleep(0)  # let the cancellations and connection_lost calls run
        await asyncio.sleep(0)

    def shutdown(self) -> None:
        """Stop serving: stop accepting, close every connection, end the loop thread."""
        if self._stopped:
            return
        self._stopped = True
        if self._thread.is_alive():
            try:
                asyncio.run_coroutine_threadsafe(self._stop(), self.loop).result(5)
            except (concurrent.futures.TimeoutError, RuntimeError):
                pass
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=5)
        self.pool.shutdown(wait=False, cancel_futures=True)

    def server_close(self) -> None:
        """Close the listening socket (after ``shutdown()``, which it calls if needed)."""
        self.shutdown()
        self.socket.close()
        if not self._thread.is_alive() and not self.loop.is_closed():
            self.loop.close()


MAX_CONNECTIONS = 512  # open client connections at most (the systemd unit's LimitNOFILE
# leaves twice that free)


def _max_connections() -> int:
    """Half the file descriptors still free (at most MAX_CONNECTIONS, at least 16): idle
    clients are turned away before accept() runs out of descriptors for the daemon and for
    scrapes."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        return MAX_CONNECTIONS
    try:
        in_use = len(os.listdir("/proc/self/fd"))
    except OSError:
        in_use = 0
    return max(16, min(MAX_CONNECTIONS, (soft - in_use) // 2))


def serve(exposition: Exposition, address: str, port: int, *,
          web_config: WebConfig | None = None, ready: Callable[[], bool] | None = None,
          read_timeout: float = READ_TIMEOUT_S, write_timeout: float = WRITE_TIMEOUT_S,
          max_connections: int | None = None, max_inflight: int = MAX_INFLIGHT,
          workers: int = WORKERS) -> _Server:
    """Serve /metrics on a background thread (IPv6 addresses work too), over TLS and with
    basic auth if ``web_config`` says so. ``ready()`` decides /-/ready's answer. Raises
    OSError if the address cannot be bound, ssl.SSLError/OSError if the TLS files cannot
    be loaded. The result has ``shutdown()``, ``server_close()`` and ``server_port``."""
    family, _, _, _, sockaddr = socket.getaddrinfo(
        address, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.listen(BACKLOG)
        sock.setblocking(False)
        tls = _TLS(web_config.tls) if web_config is not None and web_config.tls else None
        auth = BasicAuth(web_config.users) if web_config is not None and web_config.users \
            else None
        return _Server(app(exposition, ready=ready, web_config=web_config, auth=auth), sock,
                       tls=tls, extra=list(web_config.headers) if web_config is not None
                       else [], read_timeout=read_timeout, write_timeout=write_timeout,
                       max_connections=max_connections or _max_connections(),
                       max_inflight=max_inflight, workers=workers, auth=auth)
    except BaseException:
        sock.close()
        raise
