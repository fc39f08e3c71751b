"""Hostile network peers against gemmd's HTTP server (issue 24), counted.

    .venv/bin/python bench/fuzz_http.py [-n 2000] [--seed 0] [--only requests,auth,burst]
                                        [--tree DIR]

Every phase runs the server in a separate process (``gemmd.exporter.http.serve`` on an
empty state, as the daemon serves it), from this checkout or from ``--tree DIR`` (another
checkout, for before/after figures); the clients run here.

- **requests**: N requests made from valid ones with one defect each, by class: request
  targets urlsplit cannot take, HTTP versions, Host missing or twice, Content-Length in
  non-ASCII digits, past int()'s 4,300 digits, negative or repeated, Transfer-Encoding,
  a CR before the CRLF, control bytes, obsolete folding, oversized lines and heads, binary
  garbage, random byte flips, and requests cut short. Each is sent in 1-5 chunks with
  small pauses, sometimes followed by a half-close. The oracle: every request that was
  sent gets a status line before ``read_timeout`` + 3 s (a request cut short: 408 or
  400); a defect that HTTP/1.1 (RFC 9110/9112) says to refuse gets a 4xx/5xx, a valid
  request a 2xx. After the run the server must still answer /-/healthy.
- **auth**: the issue's starvation case with real bcrypt: ``--attackers`` clients (from 4
  loopback addresses) send distinct wrong passwords (cost ``--cost``) for ``--seconds``,
  while Prometheus (from 127.0.0.1, with the right password) scrapes every 0.5 s: its
  statuses and latency, the attackers' statuses, the server's CPU, its log lines.
- **burst**: ``--burst`` scrapes sent at once (every request written before any answer
  is read) while ``--idle`` connections are held open, ``--bursts`` times.

Figures, not assertions: exit status 1 if any request case failed or Prometheus's scrapes
failed. tests/test_http.py runs a sample of the request classes in CI.
"""

from __future__ import annotations

import argparse
import base64
import collections
import concurrent.futures
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
READ_TIMEOUT_S = 1.0

SERVER = """
import logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(message)s")
from gemmd.exporter.exposition import Exposition
from gemmd.config import load_web_config
from gemmd.exporter.http import serve
from gemmd.state import State
web = load_web_config(sys.argv[1]) if sys.argv[1] else None
httpd = serve(Exposition(State(), process=False), "127.0.0.1", 0, web_config=web,
              read_timeout={read_timeout}, max_connections=1000)
print(httpd.server_port, flush=True)
sys.stdin.read()
"""


class Server:
    """The server in its own process (``tree``'s gemmd), stopped on exit."""

    def __init__(self, tree: Path, web_config: str = "", read_timeout: float = READ_TIMEOUT_S):
        self.log = tempfile.NamedTemporaryFile(prefix="gemmd-http-", suffix=".log")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", SERVER.format(read_timeout=read_timeout), web_config],
            cwd=tree, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
            env={**os.environ, "PYTHONPATH": str(tree)})
        assert self.proc.stdout is not None
        self.port = int(self.proc.stdout.readline())

    def cpu_s(self) -> float:
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def log_text(self) -> str:
        return Path(self.log.name).read_text(errors="replace")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)
        self.log.close()


# ------------------------------------------------------------------------ requests

OK = b"GET /metrics HTTP/1.1\r\nHost: x\r\nAccept-Encoding: gzip\r\n\r\n"


@dataclass
class Case:
    kind: str
    data: bytes
    expect: str  # "2xx", "refuse" (4xx/5xx), "any" (a status line), "cut" (408/400)


def _req(line: bytes = b"GET /metrics HTTP/1.1", headers: tuple[bytes, ...] = (b"Host: x",),
         eol: bytes = b"\r\n", body: bytes = b"") -> bytes:
    return line + eol + b"".join(h + eol for h in headers) + eol + body


UNICODE_DIGITS = ["\u00b9", "\u00b2", "\u0663", "\uff15", "\u0967", "\u2081"]


def cases_of_class(r: random.Random) -> list[Case]:
    """One case per defect, by class (the systematic part)."""
    out = []
    for t in (b"http://[/metrics", b"http://[::1/metrics", b"https://a]b/metrics",
              b"http://x:y/metrics", b"http://a b/", b"//metrics", b"*", b"metrics",
              b"http:/metrics", b"ftp://x/metrics", b"http://[::1]]/metrics", b"http://[zz]/"):
        out.append(Case("target", _req(b"GET " + t + b" HTTP/1.1"), "refuse"))
    for t in (b"http://[::1]:9477/metrics", b"http://user@h/metrics", b"HTTP://H/metrics",
              b"/metrics?x=%zz", b"/metrics?", b"http://h", b"/%6detrics"):
        out.append(Case("target ok", _req(b"GET " + t + b" HTTP/1.1"), "2xx"))
    for v in (b"HTTP/2.0", b"HTTP/0.9", b"HTTP/10.1", b"HTTP/1", b"http/1.1", b"HTTP/1.1 ",
              b"HTTP/1.1x", b""):
        out.append(Case("version", _req(b"GET /metrics " + v), "refuse"))
    out.append(Case("version ok", _req(b"GET /metrics HTTP/1.0", ()), "2xx"))
    out += [Case("host", _req(headers=()), "refuse"),
            Case("host", _req(headers=(b"Host: a", b"Host: b")), "refuse"),
            Case("host", _req(headers=(b"Host: a\x00",)), "refuse"),
            Case("host", _req(headers=(b"Host : a",)), "refuse"),
            Case("host ok", _req(headers=(b"hOsT: a",)), "2xx")]
    for cl in [d.encode() for d in UNICODE_DIGITS] + [d.encode("latin-1") for d in "\u00b9\u00b2"] \
            + [b"9" * 5000, b"9" * 4301, b"-1", b"+1", b"1,1", b"1, 2", b"0x10", b"1e3",
               b"1 1", b"\xff"]:
        out.append(Case("content-length", _req(headers=(b"Host: x", b"Content-Length: " + cl)),
                        "refuse"))
    out.append(Case("content-length", _req(headers=(b"Host: x", b"Content-Length: 1",
                                                    b"Content-Length: 2"), body=b"ab"),
                    "refuse"))
    out.append(Case("content-length ok", _req(headers=(b"Host: x", b"Content-Length: 5"),
                                              body=b"hello"), "2xx"))
    for te in (b"chunked", b"gzip", b"chunked, chunked", b"identity", b"\x0bchunked"):
        out.append(Case("transfer-encoding", _req(headers=(b"Host: x",
                                                           b"Transfer-Encoding: " + te),
                                                  body=b"0\r\n\r\n"), "refuse"))
    out += [Case("line ends", b"GET /metrics HTTP/1.1\r\r\nHost: x\r\n\r\n", "refuse"),
            Case("line ends", b"GET /metrics HTTP/1.1\r\nHost: x\r\r\n\r\n", "refuse"),
            Case("line ends", b"GET /metrics HTTP/1.1\rHost: x\r\r", "cut"),
            Case("line ends", b"GET /metrics HTTP/1.1\r\n\rHost: x\r\n\r\n", "refuse"),
            Case("line ends ok", _req(eol=b"\n"), "2xx"),
            Case("line ends ok", b"\r\n\r\n" + OK, "2xx")]
    for hv in (b"a\x00b", b"a\rb"):  # RFC 9110 5.5: NUL and CR must be refused
        out.append(Case("control bytes", _req(headers=(b"Host: x", b"X-A: " + hv)), "refuse"))
    for hv in (b"a\x7fb", b"\x1b[31m", b"a\x01"):  # other CTLs "MAY" be retained
        out.append(Case("control bytes", _req(headers=(b"Host: x", b"X-A: " + hv)), "any"))
    out += [Case("control bytes", _req(b"GET /met\x00rics HTTP/1.1"), "refuse"),
            Case("control bytes", _req(headers=(b"Host: x", b"X\x00A: b")), "refuse"),
            Case("folding ok", _req(headers=(b"Host: x", b"X-A: b", b" folded")), "2xx"),
            Case("size", _req(b"GET /" + b"a" * 20000 + b" HTTP/1.1"), "refuse"),
            Case("size", _req(headers=(b"Host: x",) + (b"X-A: b",) * 2000), "refuse"),
            Case("size", _req(headers=(b"Host: x", b"X-A: " + b"b" * 17000)), "refuse"),
            Case("size", b"\r\n" * 20000, "refuse"),
            Case("method", _req(b"get /metrics HTTP/1.1"), "refuse"),
            Case("method", _req(b"G(T /metrics HTTP/1.1"), "refuse"),
            Case("method", b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03", "refuse"),
            Case("method", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", "refuse")]
    return out


def random_case(r: random.Random) -> Case:
    """A valid request with random damage, or cut short."""
    base = r.choice([OK, _req(b"HEAD / HTTP/1.1"), _req(b"GET /-/healthy HTTP/1.0", ()),
                     _req(headers=(b"Host: x", b"Content-Length: 3"), body=b"abc")])
    if r.random() < 0.3:
        cut = r.randrange(1, len(base))
        return Case("cut short", base[:cut], "cut" if b"\n\n" not in base[:cut].replace(
            b"\r", b"") else "any")
    data = bytearray(base)
    for _ in range(r.randint(1, 4)):
        i = r.randrange(len(data))
        op = r.random()
        if op < 0.4:
            data[i] = r.randrange(256)
        elif op < 0.7:
            data.insert(i, r.choice(b"\r\n :\x00\t/%[]\xff0"))
        else:
            del data[i]
    return Case("random damage", bytes(data), "any")


def send(port: int, case: Case, r: random.Random) -> str:
    """What the server answered: '200', '400', ..., 'no answer', 'hang'."""
    data = case.data
    cuts = sorted(r.sample(range(1, len(data)), min(len(data) - 1, r.randint(0, 4))))
    chunks = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)])]
    deadline = time.monotonic() + READ_TIMEOUT_S + 3
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            for c in chunks:
                try:
                    s.sendall(c)
                except OSError:
                    break  # answered and closed already
                time.sleep(r.random() * 0.003)
            if r.random() < 0.2 and case.expect != "cut":
                try:
                    s.shutdown(socket.SHUT_WR)
                except OSError:
                    pass
            got = b""
            while time.monotonic() < deadline:
                s.settimeout(max(0.01, deadline - time.monotonic()))
                try:
                    chunk = s.recv(65536)
                except (ConnectionResetError, BrokenPipeError):
                    break
                except TimeoutError:
                    return "hang"
                if not chunk:
                    break
                got += chunk
            else:
                return "hang"
    except OSError as e:
        return type(e).__name__
    if not got.startswith(b"HTTP/1.1 "):
        return "no answer"
    return got.split(b" ", 2)[1].decode()


def judge(case: Case, got: str) -> str | None:
    """None if right, else why not."""
    if not got.isdigit():
        return got
    code = int(got)
    if case.expect == "2xx" and not 200 <= code < 300:
        return f"{code} to a valid request"
    if case.expect == "refuse" and code < 400:
        return f"{code} to a request that must be refused"
    if case.expect == "cut" and code not in (400, 408):
        return f"{code} to a request cut short"
    return None


def requests_phase(tree: Path, n: int, r: random.Random, threads: int) -> bool:
    srv = Server(tree)
    try:
        cases = cases_of_class(r)
        cases += [random_case(r) for _ in range(max(0, n - len(cases)))]
        r.shuffle(cases)
        seeds = [r.randrange(1 << 30) for _ in cases]
        t0 = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(threads) as pool:
            got = list(pool.map(lambda cs: send(srv.port, cs[0], random.Random(cs[1])),
                                zip(cases, seeds)))
        took = time.monotonic() - t0
        by_kind: dict[str, collections.Counter] = {}
        bad: list[str] = []
        for c, g in zip(cases, got):
            verdict = judge(c, g)
            cnt = by_kind.setdefault(c.kind, collections.Counter())
            cnt["cases"] += 1
            cnt["bad" if verdict else "clean"] += 1
            if verdict:
                bad.append(f"{c.kind}: {c.data[:80]!r} -> {verdict}")
        healthy = send(srv.port, Case("health", b"GET /-/healthy HTTP/1.1\r\nHost: x\r\n\r\n",
                                      "2xx"), r) == "200"
        errors = [ln for ln in srv.log_text().splitlines() if ln.startswith(("ERROR",
                                                                              "Traceback"))]
    finally:
        srv.stop()
    total = sum(c["cases"] for c in by_kind.values())
    nbad = sum(c["bad"] for c in by_kind.values())
    print(f"requests: {total} cases in {took:.0f} s ({threads} at a time): "
          f"{total - nbad} clean, {nbad} bad; /-/healthy after: "
          f"{'200' if healthy else 'NO ANSWER'}; server ERROR lines: {len(errors)}\n")
    print("| class | cases | clean | bad |\n|---|---|---|---|")
    for kind, c in sorted(by_kind.items()):
        print(f"| {kind} | {c['cases']} | {c['clean']} | {c['bad']} |")
    for line in bad[:40]:
        print("BAD", line)
    for line in errors[:5]:
        print("LOG", line)
    print()
    return not bad and healthy


# ---------------------------------------------------------------------------- auth

def auth_phase(tree: Path, attackers: int, seconds: float, cost: int) -> bool:
    import bcrypt

    with tempfile.TemporaryDirectory() as tmp:
        web = Path(tmp) / "web.yml"
        web.write_text("basic_auth_users:\n  prometheus: "
                       f"{bcrypt.hashpw(b's3cret', bcrypt.gensalt(cost)).decode()}\n")
        srv = Server(tree, str(web), read_timeout=10.0)
        try:
            return _auth(srv, attackers, seconds, cost)
        finally:
            srv.stop()


def _get(port: int, user: str, password: str, source: str, timeout: float = 15.0) -> str:
    import http.client

    token = base64.b64encode(f"{user}:{password}".encode()).decode()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout,
                                      source_address=(source, 0))
    try:
        conn.request("GET", "/metrics", headers={"Authorization": f"Basic {token}"})
        r = conn.getresponse()
        r.read()
        return str(r.status)
    except OSError as e:
        return type(e).__name__
    finally:
        conn.close()


def _auth(srv: Server, attackers: int, seconds: float, cost: int) -> bool:
    stop, lock = threading.Event(), threading.Lock()
    bad: collections.Counter = collections.Counter()

    def attacker(i: int) -> None:
        n = 0
        while not stop.is_set():
            n += 1
            got = _get(srv.port, "prometheus", f"guess-{i}-{n}", f"127.0.0.{2 + i % 4}")
            with lock:
                bad[got] += 1

    c0 = srv.cpu_s()
    threads = [threading.Thread(target=attacker, args=(i,), daemon=True)
               for i in range(attackers)]
    for t in threads:
        t.start()
    good: collections.Counter = collections.Counter()
    lat = []
    t_end = time.monotonic() + seconds
    while time.monotonic() < t_end:
        t = time.monotonic()
        good[_get(srv.port, "prometheus", "s3cret", "127.0.0.1")] += 1
        lat.append(1e3 * (time.monotonic() - t))
        time.sleep(max(0.0, 0.5 - (time.monotonic() - t)))
    stop.set()
    for t in threads:
        t.join(20)
    cpu = srv.cpu_s() - c0
    lat.sort()
    p99 = lat[min(len(lat) - 1, int(0.99 * len(lat)))] if lat else float("nan")
    lines = [ln for ln in srv.log_text().splitlines() if "auth" in ln]
    print(f"auth: {attackers} clients with distinct wrong passwords (bcrypt cost {cost}) for "
          f"{seconds:.0f} s; Prometheus every 0.5 s with the right one:\n")
    print(f"- Prometheus: {dict(good)}; latency p50 {lat[len(lat) // 2]:.1f} ms, p99 "
          f"{p99:.1f} ms, max {lat[-1]:.1f} ms")
    print(f"- attackers: {sum(bad.values())} requests: {dict(bad)}")
    print(f"- server CPU {cpu:.1f} s over {seconds:.0f} s ({100 * cpu / seconds:.0f}% of a core); "
          f"{len(lines)} auth log line(s)" + (f": {lines[0][:200]}" if lines else ""))
    print()
    return set(good) == {"200"}


# --------------------------------------------------------------------------- burst

def burst_phase(tree: Path, burst: int, idle: int, bursts: int) -> bool:
    srv = Server(tree, read_timeout=60.0)
    held: list[socket.socket] = []
    got: collections.Counter = collections.Counter()
    try:
        held = [socket.create_connection(("127.0.0.1", srv.port), timeout=10)
                for _ in range(idle)]
        for _ in range(bursts):
            socks = [socket.create_connection(("127.0.0.1", srv.port), timeout=30)
                     for _ in range(burst)]
            for s in socks:
                s.sendall(OK)
            for s in socks:
                data = b""
                try:
                    while chunk := s.recv(65536):
                        data += chunk
                except OSError:
                    pass
                s.close()
                got[data.split(b" ", 2)[1].decode() if data.startswith(b"HTTP/1.1 ")
                    else "no answer"] += 1
    finally:
        for s in held:
            s.close()
        srv.stop()
    print(f"burst: {bursts} x {burst} scrapes sent at once beside {idle} idle connections: "
          f"{dict(got)}\n")
    return set(got) == {"200"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", type=int, default=2000, help="request cases")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=16)
    ap.add_argument("--only", default="requests,auth,burst")
    ap.add_argument("--tree", type=Path, default=ROOT, help="the checkout whose gemmd serves")
    ap.add_argument("--attackers", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--cost", type=int, default=10)
    ap.add_argument("--burst", type=int, default=100)
    ap.add_argument("--idle", type=int, default=300)
    ap.add_argument("--bursts", type=int, default=5)
    a = ap.parse_args()
    only = set(a.only.split(","))
    ok = True
    print(f"# fuzz_http seed {a.seed}, {os.cpu_count()} cores, Python "
          f"{sys.version.split()[0]}, gemmd from {a.tree}\n")
    if "requests" in only:
        ok &= requests_phase(a.tree, a.n, random.Random(a.seed), a.threads)
    if "auth" in only:
        ok &= auth_phase(a.tree, a.attackers, a.seconds, a.cost)
    if "burst" in only:
        ok &= burst_phase(a.tree, a.burst, a.idle, a.bursts)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
