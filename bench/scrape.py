"""Exporter benchmark: scrape latency, exposition size, RSS and CPU of a running daemon.

For 1 and 8 simulated GPUs (``backend: fake``, 100 sentinel probes each, one probe round
per hour so that only the first round runs) this starts ``gemmd run`` on a temporary config
and state_dir and waits until every sentinel has an ok result and the random-forest model
is fitted (run 1: start-up time, RSS before and after the fit). It then restarts the daemon
on that state (run 2), so that every sentinel carries forest predictions with power and
energy, as in steady state, waits for its round and measures: scrape latency (p50/p99/max
of sequential GET /metrics, new connection each; also Prometheus-like OpenMetrics + gzip),
exposition size, daemon CPU per scrape, idle CPU (utime+stime from /proc/PID/stat over a
window without scrapes, % of one core), RSS (VmRSS/VmHWM from /proc/PID/status) and the
time SIGTERM takes to stop it. Targets are printed beside the figures, never asserted:
scrape p99 <= 10 ms, idle CPU <= 1 % of a core, RSS <= 250 MB. The exit status is non-zero
only if the daemon fails to start or never exports the expected series.

    .venv/bin/python bench/scrape.py                  # full run (a few minutes)
    .venv/bin/python bench/scrape.py --quick          # smoke test: 20 scrapes, 2 s idle
    .venv/bin/python bench/scrape.py --markdown bench/RESULTS.md   # also record the run
"""

from __future__ import annotations

import argparse
import datetime
import http.client
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

import gemmd

_SCRIPT = Path(sys.executable).with_name("gemmd")
GEMMD = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "gemmd"]
TICK = os.sysconf("SC_CLK_TCK")
SECTION = "## Exporter: scrape latency, RSS, CPU (bench/scrape.py)"
TARGETS = {"p99": (10.0, "10 ms"), "idle_cpu": (1.0, "1 %"), "rss_mb": (250.0, "250 MB"),
           "fit_rss": (250.0, "250 MB")}
SIZES = (1024, 2048, 3072, 4096, 6144)
PLAN = {"shapes": [[m, n, 4096] for m in SIZES for n in SIZES],  # 25 shapes x 4 dtypes
        "dtypes": ["bf16", "fp16", "fp32", "tf32"], "kernels": ["blas"], "layouts": ["nn"],
        "backends": ["fake"]}
PER_DEVICE = 100


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_config(path: Path, n: int, port: int, state_dir: Path) -> None:
    cfg = {"listen": {"address": "127.0.0.1", "port": port}, "state_dir": str(state_dir),
           "backend": "fake", "log_level": "info",
           "probes": {"sentinels": [PLAN], "exploration": [],
                      # >= 0.1 s: the (fake) energy counter moves in 100 ms steps
                      "measure": {"warmup_s": 0.01, "window_s": 0.2}},
           "schedule": {"probe_interval_s": 3600}, "budget": {"duty_cycle": 1.0},
           "model": {"min_samples": 30},
           "fake": {"devices": [{"model": "H100-SXM"} for _ in range(n)]}}
    path.write_text(json.dumps(cfg, indent=1))  # JSON is valid YAML


PROM_ACCEPT = ("application/openmetrics-text;version=1.0.0;q=0.5,"
               "text/plain;version=0.0.4;q=0.3,*/*;q=0.2")  # as Prometheus asks


def scrape(port: int, prom: bool = False, timeout: float = 10.0) -> bytes:
    """One GET /metrics on a new connection; prom: OpenMetrics + gzip, like Prometheus."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", "/metrics", headers={"Accept": PROM_ACCEPT,
                                                 "Accept-Encoding": "gzip"} if prom else {})
        resp = conn.getresponse()
        body = resp.read()
        if resp.status != 200:
            raise RuntimeError(f"GET /metrics: HTTP {resp.status}")
        return body
    finally:
        conn.close()


def samples(body: bytes) -> list:
    return [s for f in text_string_to_metric_families(body.decode()) for s in f.samples]


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime, stime (fields 14, 15)


def proc_status(pid: int, key: str) -> int:  # kB for the Vm* keys
    line = next(ln for ln in Path(f"/proc/{pid}/status").read_text().splitlines()
                if ln.startswith(key + ":"))
    return int(line.split()[1])


def timed(port: int, n: int, prom: bool = False) -> tuple[float, float, float]:
    """p50, p99 and max latency in ms of n sequential scrapes."""
    lat = []
    for _ in range(n):
        t = time.perf_counter()
        scrape(port, prom)
        lat.append(1e3 * (time.perf_counter() - t))
    lat.sort()
    return lat[round(0.5 * (n - 1))], lat[round(0.99 * (n - 1))], lat[-1]


def wait_ready(proc: subprocess.Popen, port: int, n: int, timeout: float = 300) -> dict:
    """Poll /metrics until n*100 ok sentinels and a fitted forest; raise on timeout/exit."""
    t0, r, ok, kind = time.monotonic(), {}, 0, "?"
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"daemon exited with status {proc.returncode} during start-up")
        try:
            ss = samples(scrape(port))
        except (OSError, RuntimeError, http.client.HTTPException):
            time.sleep(0.1)
            continue
        ok = sum(s.value for s in ss if s.name == "gemmd_probes_total"
                 and s.labels.get("kind") == "sentinel" and s.labels.get("outcome") == "ok")
        kind = next((s.labels["kind"] for s in ss if s.name == "gemmd_model_info"), "?")
        if not r:  # RSS before the first fit imports scikit-learn
            r = {"serving_s": time.monotonic() - t0, "rss0_mb": proc_status(
                proc.pid, "VmRSS") / 1024 if kind == "roofline" else float("nan")}
        if ok >= n * PER_DEVICE and kind == "random_forest":
            return {**r, "ready_s": time.monotonic() - t0}
        time.sleep(0.2)
    what = "never served /metrics" if not r else \
        f"{ok:.0f}/{n * PER_DEVICE} ok sentinel probes, model kind {kind!r}"
    raise RuntimeError(f"timeout after {timeout:.0f} s: {what}")


def stop(proc: subprocess.Popen) -> tuple[float, int | str]:
    """SIGTERM; seconds until exit and the exit status (killed after 30 s)."""
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        code: int | str = proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = "hung: killed after 30 s"
    return time.monotonic() - t0, code


def bench(n: int, scrapes: int, idle_s: float, tmp: Path) -> dict:
    """Run 1: fresh state until all probes are ok and the model is fitted. Run 2, measured:
    a restart on that state, so that every sentinel carries forest predictions (the first
    round's are roofline ones, with no power/energy): the steady-state exposition."""
    port, state, conf, procs = free_port(), tmp / f"state-{n}", tmp / f"gemmd-{n}.yaml", []
    write_config(conf, n, port, state)

    def start(run: int) -> subprocess.Popen:
        with (tmp / f"gemmd-{n}-{run}.log").open("wb") as logf:
            procs.append(subprocess.Popen([*GEMMD, "run", "--config", str(conf), "--state-dir",
                                           str(state), "--port", str(port)], stdout=logf,
                                          stderr=subprocess.STDOUT))
        return procs[-1]

    try:
        proc = start(1)
        r = {"devices": n, **wait_ready(proc, port, n),
             "fit_rss": proc_status(proc.pid, "VmRSS") / 1024,
             "fit_hwm": proc_status(proc.pid, "VmHWM") / 1024}
        r["stop1_s"], r["exit1"] = stop(proc)
        proc = start(2)
        r2 = wait_ready(proc, port, n)
        r["serve2_s"], r["ready2_s"] = r2["serving_s"], r2["ready_s"]
        for _ in range(5):  # warm-up
            body = scrape(port)
        ss = samples(body)
        r["bytes"], r["gz_bytes"] = len(body), len(scrape(port, prom=True))
        r["samples"] = len(ss)
        r["probe_samples"] = sum(s.name.startswith("gemmd_probe_") for s in ss)
        c0 = cpu_s(proc.pid)
        r["p50"], r["p99"], r["max"] = timed(port, scrapes)
        r["cpu_ms"] = 1e3 * (cpu_s(proc.pid) - c0) / scrapes
        r["prom_p50"], r["prom_p99"], _ = timed(port, max(10, scrapes // 5), prom=True)
        r["collect_ms"] = 1e3 * next(s.value for s in samples(scrape(port))
                                     if s.name == "gemmd_scrape_duration_seconds")
        time.sleep(1.0)  # let the last request's thread finish before the idle window
        c0, t0 = cpu_s(proc.pid), time.monotonic()
        time.sleep(idle_s)
        r["idle_cpu"] = 100 * (cpu_s(proc.pid) - c0) / (time.monotonic() - t0)
        r["rss_mb"] = proc_status(proc.pid, "VmRSS") / 1024
        r["hwm_mb"] = proc_status(proc.pid, "VmHWM") / 1024
        r["threads"] = proc_status(proc.pid, "Threads")
        r["stop_s"], r["exit"] = stop(proc)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    lines = [ln for run in (1, 2) for ln in (tmp / f"gemmd-{n}-{run}.log").read_text(
        errors="replace").splitlines()]
    r["problems"] = [ln for ln in lines if " WARNING " in ln or " ERROR " in ln
                     or "Traceback" in ln]
    r["log_lines"], r["log_problems"] = len(lines), len(r["problems"])
    return r


def machine() -> str:
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text()
                .splitlines() if ln.startswith("model name")), platform.machine())
    git = ["git", "-C", str(Path(__file__).resolve().parent.parent)]
    try:
        rev = "git " + subprocess.run([*git, "rev-parse", "--short", "HEAD"], check=True,
                                      capture_output=True, text=True).stdout.strip()
        if subprocess.run([*git, "status", "--porcelain", "--", "gemmd"], capture_output=True,
                          text=True).stdout.strip():
            rev += " + uncommitted changes in gemmd/"
    except (OSError, subprocess.CalledProcessError):
        rev = "git revision unknown"
    return (f"{cpu}, {os.cpu_count()} cores, Linux {platform.release()}, Python "
            f"{platform.python_version()}, prometheus_client {version('prometheus_client')}; "
            f"gemmd {gemmd.__version__} ({rev})")


ROWS = (  # label, format over the results, the key compared with TARGETS
    ("run 1: time to serve / all ok + fitted", "{serving_s:.2f} s / {ready_s:.2f} s", ""),
    ("run 1: RSS before the first fit", "{rss0_mb:.0f} MB", ""),
    ("run 1: RSS / peak after the fit", "{fit_rss:.0f} MB / {fit_hwm:.0f} MB", "fit_rss"),
    ("run 2 (restart): time to serve / all ok", "{serve2_s:.2f} s / {ready2_s:.2f} s", ""),
    ("exposition size (text / OpenMetrics gzip)", "{bytes:,} B / {gz_bytes:,} B", ""),
    ("samples (of which gemmd_probe_*)", "{samples} ({probe_samples})", ""),
    ("scrape latency p50", "{p50:.2f} ms", ""),
    ("scrape latency p99 / max", "{p99:.2f} ms / {max:.2f} ms", "p99"),
    ("Prometheus-like scrape p50 / p99", "{prom_p50:.2f} ms / {prom_p99:.2f} ms", ""),
    ("collect() duration (gemmd's own gauge)", "{collect_ms:.2f} ms", ""),
    ("daemon CPU per scrape", "{cpu_ms:.2f} ms", ""),
    ("idle CPU (% of one core)", "{idle_cpu:.2f} %", "idle_cpu"),
    ("RSS (VmRSS) / peak (VmHWM)", "{rss_mb:.0f} MB / {hwm_mb:.0f} MB", "rss_mb"),
    ("threads", "{threads}", ""),
    ("SIGTERM to exit (exit code): run 1 / 2", "{stop1_s:.2f} s ({exit1}) / "
                                                "{stop_s:.2f} s ({exit})", ""),
    ("log lines (warnings/errors), both runs", "{log_lines} ({log_problems})", ""),
)


def table(results: list[dict]) -> list[list[str]]:
    out = [["metric", *(f"{r['devices']} GPU(s)" for r in results), "target"]]
    for label, fmt, key in ROWS:
        cells = [fmt.format(**r) + ((" ok" if r[key] <= TARGETS[key][0] else " MISSED")
                                    if key else "") for r in results]
        out.append([label, *cells, f"<= {TARGETS[key][1]}" if key else ""])
    return out


def write_markdown(path: Path, head: str, rows: list[list[str]]) -> None:
    """Insert this run at the top of the section (newest first), creating what is missing."""
    block = "\n".join([head, "", "| " + " | ".join(rows[0]) + " |", "|---" * len(rows[0]) + "|",
                       *("| " + " | ".join(r) + " |" for r in rows[1:])])
    text = path.read_text() if path.exists() else (
        "# Benchmark results\n\nLatest results of the benchmarks in bench/, newest first per "
        "benchmark; each section names date and machine.\n")
    if SECTION not in text:
        text = text.rstrip("\n") + f"\n\n{SECTION}\n\n"
    before, rest = text.split(SECTION, 1)
    cut = min(i for i in (rest.find("\n### "), rest.find("\n## "), len(rest)) if i >= 0)
    path.write_text(before + SECTION + rest[:cut].rstrip("\n") + "\n\n" + block + "\n\n"
                    + rest[cut:].strip("\n") + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="20 scrapes, 2 s idle window (smoke test)")
    ap.add_argument("--scrapes", type=int, help="timed scrapes per run (default 500)")
    ap.add_argument("--idle", type=float, help="idle window in seconds (default 20)")
    ap.add_argument("--devices", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--markdown", type=Path, help="insert the results into this file")
    a = ap.parse_args()
    scrapes, idle = a.scrapes or (20 if a.quick else 500), a.idle or (2.0 if a.quick else 20.0)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that `finally` runs
    results, load0 = [], os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="gemmd-bench-") as tmp:
        for n in a.devices:
            try:
                results.append(bench(n, scrapes, idle, Path(tmp)))
            except KeyboardInterrupt:
                print("scrape bench: interrupted", file=sys.stderr)
                return 130
            except (RuntimeError, OSError, http.client.HTTPException) as e:
                print(f"scrape bench, {n} device(s): {e}", file=sys.stderr)
                for log in sorted(Path(tmp).glob(f"gemmd-{n}-*.log")):
                    print(f"--- {log.name} (tail) ---\n{log.read_text()[-3000:]}",
                          file=sys.stderr)
                return 1
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    what = (f"{scrapes} sequential scrapes (new connection each; Prometheus-like: "
            f"{max(10, scrapes // 5)}), {idle:g} s idle window, {PER_DEVICE} sentinel probes "
            f"per device; 1-min load average {load0:.2f} at start, {os.getloadavg()[0]:.2f} "
            "at end")
    rows = table(results)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    print(f"{now}; {machine()}\n{what}\n")
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    for r in results:
        for line in r["problems"][:10]:
            print(f"[{r['devices']} GPU(s)] log: {line}")
    if a.markdown:
        cmd = " ".join(["python bench/scrape.py", *sys.argv[1:]])
        write_markdown(a.markdown, f"### {now}\n\nMachine: {machine()}.\n\n`{cmd}`: {what}.",
                       rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
