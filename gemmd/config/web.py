"""The web configuration file: TLS and basic auth for the exporter, in the format of
Prometheus exporter-toolkit (node_exporter's and dcgm-exporter's ``--web.config.file``).

Read with the hardened reader (gemmd.files) and validated with gemmd.yaml (``gemmd check``
says what is wrong with either), so that the exporter only ever serves a web configuration
that loaded: every problem is one line of a ConfigError naming its key.
"""

from __future__ import annotations

import os
import re
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gemmd.errors import ConfigError
from gemmd.files import read_file, read_yaml, ssl_reason, unreadable  # the hardened reader

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
                        f"{ssl_reason(e)}")
        return None
    return settings


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
