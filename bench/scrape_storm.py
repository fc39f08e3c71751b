"""Scrape latency under hostile load: alone, during a request storm, with idle clients.

Starts ``gemmd run`` on the fake backend with 8 simulated GPUs and 100 sentinel probes each
(bench/scrape.py's configuration and helpers) and waits until every probe has a result and
the model is fitted. Then, everything on 127.0.0.1, it measures a normal scrape (one GET
/metrics on a new connection, Prometheus-like: OpenMetrics Accept, gzip) three ways:

1. alone: ``--scrapes`` sequential scrapes;
2. during a storm: ``--clients`` concurrent clients (in ``--procs`` separate processes, so
   that the measuring client keeps its own interpreter) each sending ``--requests`` scrapes
   back to back, uncompressed with ``--storm-plain``; the normal scrapes run until the storm
   ends;
3. with ``--slow`` idle clients: connected, sending nothing, held open while
   ``--scrapes`` normal scrapes run, then ``--bursts`` times ``--burst`` scrapes sent at
   once (every request written before any answer is read: Prometheus HA pairs and
   dashboards scraping together; issue 24 found 32-39 of 100 answered, the rest 503).

It prints p50/p99/max of the normal scrapes and how many failed (an error or a status
other than 200), what the storm clients got (200, 503, errors) and their throughput, how
many idle sockets the server had closed, and the daemon's CPU, RSS and threads. Every phase
is bounded in count and in time (``--deadline`` seconds each); the daemon is stopped at the
end. The exit status is non-zero only if the daemon does not start.

    .venv/bin/python bench/scrape_storm.py            # ~1-2 minutes
    .venv/bin/python bench/scrape_storm.py --quick    # smoke test
"""

from __future__ import annotations

import argparse
import collections
import datetime
import http.client
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import scrape as base  # noqa: E402  (bench/scrape.py: config, start-up, scrape helpers)

machine = base.machine  # CPU, cores, kernel, Python, library versions, revision


def timed_scrape(port: int, prom: bool = True, timeout: float = 10.0) -> tuple[float, bool]:
    """(latency in ms, ok) of one scrape on a new connection."""
    t = time.perf_counter()
    try:
        base.scrape(port, prom=prom, timeout=timeout)
        ok = True
    except (OSError, RuntimeError, http.client.HTTPException):
        ok = False
    return 1e3 * (time.perf_counter() - t), ok


def percentiles(lat: list[float]) -> tuple[float, float, float]:
    s = sorted(lat) or [float("nan")]
    return s[round(0.5 * (len(s) - 1))], s[round(0.99 * (len(s) - 1))], s[-1]


def storm_process(port: int, threads: int, requests: int, deadline: float, plain: bool,
                  out: multiprocessing.Queue) -> None:
    """``threads`` clients, each sending ``requests`` scrapes back to back (until the
    deadline); puts {status or error name: count} on ``out``."""
    counts: dict[str, int] = {}
    lock = threading.Lock()

    def client() -> None:
        for _ in range(requests):
            if time.time() > deadline:
                break
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            try:
                conn.request("GET", "/metrics", headers={} if plain else {
                    "Accept": base.PROM_ACCEPT, "Accept-Encoding": "gzip"})
                r = conn.getresponse()
                r.read()
                key = str(r.status)
            except (OSError, http.client.HTTPException) as e:
                key = type(e).__name__
            finally:
                conn.close()
            with lock:
                counts[key] = counts.get(key, 0) + 1

    ts = [threading.Thread(target=client) for _ in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    out.put(counts)


def storm(port: int, a: argparse.Namespace) -> dict:
    ctx = multiprocessing.get_context("fork")
    out: multiprocessing.Queue = ctx.Queue()
    deadline = time.time() + a.deadline
    per = [a.clients // a.procs + (i < a.clients % a.procs) for i in range(a.procs)]
    procs = [ctx.Process(target=storm_process, args=(port, n, a.requests, deadline,
                                                     a.storm_plain, out), daemon=True)
             for n in per if n]
    t0 = time.monotonic()
    for p in procs:
        p.start()
    lat, failed = [], 0
    while any(p.is_alive() for p in procs) and time.time() < deadline + 15:
        ms, ok = timed_scrape(port)
        lat.append(ms)
        failed += not ok
        time.sleep(0.02)
    counts: dict[str, int] = {}
    for _ in procs:
        try:
            for k, v in out.get(timeout=max(1.0, deadline + 20 - time.time())).items():
                counts[k] = counts.get(k, 0) + v
        except Exception:  # noqa: BLE001 - a storm process that died: counted as missing
            counts["lost"] = counts.get("lost", 0) + 1
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
    took = time.monotonic() - t0
    return {"lat": lat, "failed": failed, "counts": counts, "took": took,
            "rate": sum(counts.values()) / took}


def slow_clients(port: int, a: argparse.Namespace) -> dict:
    socks: list[socket.socket] = []
    refused = 0
    try:
        for _ in range(a.slow):
            s = socket.socket()
            s.settimeout(2)
            try:
                s.connect(("127.0.0.1", port))
                socks.append(s)
            except OSError:
                s.close()
                refused += 1
        time.sleep(0.5)
        lat, failed, t_end = [], 0, time.monotonic() + a.deadline
        for _ in range(a.scrapes):
            if time.monotonic() > t_end:
                break
            ms, ok = timed_scrape(port)
            lat.append(ms)
            failed += not ok
        burst: collections.Counter = collections.Counter()
        for _ in range(a.bursts):
            for k, v in parallel_burst(port, a.burst).items():
                burst[k] += v
        closed = 0
        for s in socks:  # which idle sockets has the server closed (EOF or reset)?
            s.setblocking(False)
            try:
                closed += s.recv(1) == b""
            except BlockingIOError:
                pass
            except OSError:
                closed += 1
        return {"lat": lat, "failed": failed, "held": len(socks), "refused": refused,
                "closed": closed, "burst": burst}
    finally:
        for s in socks:
            s.close()


def parallel_burst(port: int, n: int, timeout: float = 30.0) -> collections.Counter:
    """``n`` scrapes at once: every request sent, then every answer read. {status: n}."""
    socks, got = [], collections.Counter()
    try:
        for _ in range(n):
            try:
                socks.append(socket.create_connection(("127.0.0.1", port), timeout=timeout))
            except OSError as e:
                got[type(e).__name__] += 1
        for s in socks:
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\nAccept-Encoding: gzip\r\n"
                      b"Accept: " + base.PROM_ACCEPT.encode() + b"\r\n\r\n")
        for s in socks:
            data = b""
            try:
                while chunk := s.recv(1 << 16):
                    data += chunk
                    if len(data) > 64:
                        break
                got[data.split(b" ", 2)[1].decode() if data.startswith(b"HTTP/1.1 ")
                    else "no answer"] += 1
            except OSError as e:
                got[type(e).__name__] += 1
    finally:
        for s in socks:
            s.close()
    return got


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--scrapes", type=int, default=200, help="normal scrapes per phase")
    ap.add_argument("--clients", type=int, default=20)
    ap.add_argument("--requests", type=int, default=500, help="per storm client")
    ap.add_argument("--procs", type=int, default=4, help="processes for the storm clients")
    ap.add_argument("--storm-plain", action="store_true",
                    help="storm with uncompressed scrapes (4 MB each for 8 GPUs)")
    ap.add_argument("--slow", type=int, default=300, help="idle clients in phase 3")
    ap.add_argument("--burst", type=int, default=100, help="scrapes at once in phase 3")
    ap.add_argument("--bursts", type=int, default=5, help="bursts in phase 3")
    ap.add_argument("--deadline", type=float, default=120.0, help="seconds per phase, at most")
    ap.add_argument("--quick", action="store_true",
                    help="1 GPU, 20 scrapes, 5 clients x 50 requests, 50 idle clients")
    a = ap.parse_args()
    if a.quick:
        a.devices, a.scrapes, a.clients, a.requests, a.slow = 1, 20, 5, 50, 50
        a.burst, a.bursts = 50, 2
        a.procs = min(a.procs, 2)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that `finally` runs
    load0 = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="gemmd-storm-") as tmp:
        port, conf, state = base.free_port(), Path(tmp) / "gemmd.yaml", Path(tmp) / "state"
        base.write_config(conf, a.devices, port, state)
        log = Path(tmp) / "gemmd.log"
        with log.open("wb") as logf:
            proc = subprocess.Popen([*base.GEMMD, "run", "--config", str(conf)],
                                    stdout=logf, stderr=subprocess.STDOUT)
        try:
            try:
                base.wait_ready(proc, port, a.devices)
            except RuntimeError as e:
                print(f"scrape storm: {e}\n{log.read_text()[-3000:]}", file=sys.stderr)
                return 1
            for _ in range(5):
                base.scrape(port, prom=True)
            size = len(base.scrape(port)), len(base.scrape(port, prom=True))
            alone = [timed_scrape(port)[0] for _ in range(a.scrapes)]
            c0 = base.cpu_s(proc.pid)
            st = storm(port, a)
            storm_cpu = base.cpu_s(proc.pid) - c0
            time.sleep(1.0)
            slow = slow_clients(port, a)
            threads = base.proc_status(proc.pid, "Threads")
            rss = base.proc_status(proc.pid, "VmHWM") / 1024
            stop_s, code = base.stop(proc)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        problems = [ln for ln in log.read_text(errors="replace").splitlines()
                    if " WARNING " in ln or " ERROR " in ln or "Traceback" in ln]
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    kind = "uncompressed" if a.storm_plain else "Prometheus-like (gzip)"
    print(f"{now}; {machine()}")
    print(f"{a.devices} fake GPU(s) x {base.PER_DEVICE} sentinel probes; exposition "
          f"{size[0]:,} B text / {size[1]:,} B gzip; normal scrape = Prometheus-like, new "
          f"connection each; 1-min load average {load0:.2f} at start, "
          f"{os.getloadavg()[0]:.2f} at end\n")
    rows = [("phase", "normal scrapes", "p50", "p99", "max", "failed", "other clients")]

    def row(name: str, lat: list[float], failed: int, other: str) -> None:
        p50, p99, mx = percentiles(lat)
        rows.append((name, str(len(lat)), f"{p50:.1f} ms", f"{p99:.1f} ms", f"{mx:.1f} ms",
                     str(failed), other))

    row("alone", alone, 0, "-")
    counts = ", ".join(f"{k}: {v}" for k, v in sorted(st["counts"].items()))
    row(f"storm {a.clients} x {a.requests}", st["lat"], st["failed"],
        f"{kind}: {counts}; {st['rate']:.0f} req/s over {st['took']:.1f} s; daemon CPU "
        f"{storm_cpu:.1f} s")
    bursts = ", ".join(f"{k}: {v}" for k, v in sorted(slow["burst"].items()))
    row(f"{a.slow} idle clients", slow["lat"], slow["failed"],
        f"{slow['held']} held open ({slow['refused']} refused), {slow['closed']} closed by "
        f"the server; {a.bursts} bursts of {a.burst} scrapes at once: {bursts}")
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    print(f"\ndaemon: {threads} threads at the end, peak RSS {rss:.0f} MB, SIGTERM to exit "
          f"{stop_s:.2f} s ({code}); {len(problems)} warning/error log lines")
    for line in problems[:10]:
        print(f"log: {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
