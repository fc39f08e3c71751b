"""Who may ask the exporter: the server's TLS context (rebuilt when its files change, the
client's certificate held against client_allowed_sans) and basic auth (bcrypt behind a
cache of verified credentials, and a gate that keeps wrong passwords from starving
scrapes).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import collections
import hashlib
import hmac
import ipaddress
import logging
import math
import os
import ssl
import threading
import time
from collections.abc import Callable, Mapping

from gemmd.config import TLSSettings
from gemmd.files import ssl_reason, unreadable

logger = logging.getLogger("gemmd.exporter.http")


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
                                 "(%s); still using the previous ones", ssl_reason(e))
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
