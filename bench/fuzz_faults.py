"""Fault campaign against the real `gemmd` commands (issues 12, 24): hostile imports,
SIGKILLs of a probing daemon, damaged or full stores, numbers in imported files checked in
the store, a second daemon, a database deleted or replaced under a running daemon, and
jumps of the wall clock, counted.

    .venv/bin/python bench/fuzz_faults.py [--imports 400] [--kills 50] [--store-reps 5]
                                          [--values 60] [--peer-reps 2]
                                          [--only import,kill,store,values,peers]
                                          [--seed 0] [--save DIR]

- **import**: N generated CSV files (mutated copies of every supported format's real rows,
  from ../shared/data when present; garbage bytes, encodings, broken quoting, hostile
  numbers and names, huge lines, FIFOs, /dev/zero, directories) through `gemmd import`
  into one store. Each run must end with status 0 having added exactly the rows it
  reports, or with status 1/2, a `gemmd:` line per problem and no row added; no traceback,
  no hang (--timeout). The store must pass `PRAGMA integrity_check` at the end.
- **kill**: a daemon on 2 fake GPUs in real time (each probe ~0.3 s) is SIGKILLed K times,
  each at a random moment once /metrics shows a probe in flight, and restarted on the same
  state; just before each kill the committed rows are read through a separate connection.
  Counts: kills that hit a probe in flight, committed rows missing after the restart,
  warnings about missing rows, tracebacks, restart time (exec to /metrics served).
- **store**: a 0-byte database, the -wal deleted or garbled after a crash, a malformed
  page, a read-only file (gemmd run without CAP_DAC_OVERRIDE: root ignores file modes) and
  a read-only filesystem, each table dropped, a full disk (a 3 MiB tmpfs, or RLIMIT_FSIZE
  where mounting is not allowed) while the daemon runs and at start. Each through `gemmd
  run` and `gemmd status`: a one-line error (exit 1) or a logged warning (the daemon runs),
  never a traceback or a hang, and no silent loss (rows missing without a word).
- **values** (issue 24): the same runtime written in forms a reader may take for another
  number (a decimal comma, '_' and ',' separators, other scripts' digits, 1e300, hex,
  a Unicode minus, a unit glued on) and headers with two columns for one quantity. The
  store is read back: a file that imports must have stored exactly what it says; a form
  gemmd cannot read for sure must be refused with one line and no row.
- **peers** (issue 24): a second `gemmd run` on the state directory of a running one
  (must exit 1 naming the first's pid, the first unharmed); `rm gemmd.db*` under a running
  daemon (the rows must be in gemmd.db after it stops, and the log must say so); gemmd.db
  replaced by another file (one error line); wall-clock jumps of -1 day, +100 days, -2 h
  and +30 min under libfaketime with the monotonic clock untouched (where installed:
  `apt-get install faketime`): the probe rounds must go on, the jump be logged once and
  counted in gemmd_clock_jumps_total, and retention (90 days, a refit every 10 s) must
  delete nothing.

Figures, not assertions: exit status 1 if any case failed. --save DIR keeps failing cases.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import csv
import io
import json
import os
import random
import re
import resource
import shutil
import signal
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

_SCRIPT = Path(sys.executable).with_name("gemmd")
GEMMD = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "gemmd"]
PR_CAPBSET_DROP, CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH = 24, 1, 2


def drop_dac() -> None:
    """In a child before exec: without CAP_DAC_OVERRIDE (and _READ_SEARCH) in its bounding
    set, root's process obeys file modes like any user (root otherwise writes a 0444 file)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH):
        if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0 and os.geteuid() == 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


# ------------------------------------------------------------------ running gemmd


@dataclass
class Run:
    args: list[str]
    rc: int | None
    out: str
    err: str
    seconds: float
    hung: bool = False

    @property
    def traceback(self) -> bool:
        return "Traceback (most recent call last)" in self.err or \
            "Traceback (most recent call last)" in self.out

    @property
    def error_lines(self) -> list[str]:
        return [ln for ln in self.err.splitlines() if ln.startswith("gemmd:")]


def gemmd(*args: str, timeout: float = 60.0, plain_user: bool = False,
          fsize: int | None = None) -> Run:
    def pre() -> None:
        if fsize is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
        if plain_user:
            drop_dac()

    t0 = time.monotonic()
    p = subprocess.Popen([*GEMMD, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         stdin=subprocess.DEVNULL, text=True, errors="replace",
                         preexec_fn=pre if (plain_user or fsize is not None) else None,
                         start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
        return Run(list(args), p.returncode, out, err, time.monotonic() - t0)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        return Run(list(args), None, out, err, time.monotonic() - t0, hung=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(port: int, path: str = "/metrics", timeout: float = 5.0) -> str | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as r:
            return r.read().decode()
    except OSError:
        return None


def metric(body: str, name: str, **labels: str) -> float:
    total = 0.0
    for ln in body.splitlines():
        if not ln.startswith(name) or ln[len(name):len(name) + 1] not in ("{", " "):
            continue
        if all(f'{k}="{v}"' in ln for k, v in labels.items()):
            total += float(ln.rsplit(" ", 1)[1])
    return total


def db_rows(db: Path) -> tuple[int, int]:
    """(rows, max id) as another process sees them (committed only); read-only."""
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10)
    try:
        n, mx = con.execute("SELECT COUNT(*), COALESCE(MAX(id), 0) FROM probes").fetchone()
        return int(n), int(mx)
    finally:
        con.close()


def daemon_config(path: Path, state: Path, port: int, *, realtime: bool = False,
                  gpus: int = 2, window_s: float = 0.2) -> Path:
    cfg = {"listen": {"address": "127.0.0.1", "port": port}, "state_dir": str(state),
           "backend": "fake", "log_level": "info",
           "probes": {"measure": {"warmup_s": 0.02, "window_s": window_s}},
           "schedule": {"probe_interval_s": 1, "refit_interval_s": 3600},
           "budget": {"duty_cycle": 1.0},
           "model": {"min_samples": 30, "n_estimators": 10},
           "fake": {"realtime": realtime, "devices": [{"model": "H100-SXM"}] * gpus}}
    path.write_text(json.dumps(cfg))
    return path


# ------------------------------------------------------------------ import


FORMATS = ("gpperf-cutlass", "gpperf-tiled", "b200", "xla", "csv")
GENERIC = ("gpu,m,n,k,dtype,layout,runtime_ms,power_w,energy_mj\n"
           + "".join(f"NVIDIA H100 80GB HBM3,{m},{n},{k},{d},nn,{t},{p},{t * p:.6g}\n"
                     for m, n, k, d, t, p in [
                         (1024, 1024, 1024, "bf16", 0.012, 420.0),
                         (4096, 4096, 4096, "bf16", 0.16, 650.0),
                         (2048, 512, 8192, "fp16", 0.03, 500.0),
                         (8192, 8192, 8192, "fp32", 33.5, 690.0),
                         (256, 256, 256, "tf32", 0.006, 180.0)] * 6))
FALLBACK = {  # a few real-looking rows per format where the shared data are absent
    "gpperf-cutlass": "timestamp,M,N,K,kernel,layout,cta_m,cta_n,cta_k,stages,epilogue,alpha,"
                      "beta,runtime_ms,power_W,gpu_name\n" + "".join(
                          f"17313728{i:02d},{s},{s},{s},cutlass_simt_sgemm_128x128_8x2_nn_"
                          f"align1,nn,64,64,32,2,linear_combination,1,0,{s / 1e4},70.1,"
                          "NVIDIA GeForce RTX 4070\n" for i, s in
                          enumerate([512, 1024, 2048, 4096] * 5)),
    "gpperf-tiled": "M,N,K,Tile Size,Execution Time\n" + "".join(
        f"{s},{s},{s},{t},{s * t / 100}\n" for s in (512, 1024, 2048) for t in (1, 4, 16, 32)),
    "b200": "gpu,dtype,m,k,n,time(us),mem_clk_freq,graph_clk_freq,avg_power(W),"
            "avg_energy(uJ)\n" + "".join(f"B200-SXM-192GB,half,{m},{m},{m},{m // 64 + 8},3996,"
                                         f"1965,200.5,{(m // 64 + 8) * 200.5}\n"
                                         for m in (64, 128, 256, 512, 1024, 2048) * 3),
    "xla": "gpu_key,b,m,n,k,dtype,flops_per_s,runtime_us_derived\n" + "".join(
        f"sm_90_H100,1,{s},{s},{s},bf16xbf16->bf16,{2 * s**3 / (s / 100):.0f},{s / 100}\n"
        for s in (256, 512, 1024, 2048, 4096) * 4),
}
HOSTILE = ["", " ", "nan", "NaN", "inf", "-inf", "-1", "0", "-0", "1e309", "1e-320", "9" * 400,
           "0x10", "1_000", "１２", "None", "[N/A]", "N/A", "\0", '"', "a,b", "\"a\"\"b\"",
           "1.5.6", "−3", "2**31", str(2**63), str(-(2**63) - 1), "1e18", "☃", "\ufeff7",
           "\u2028", "DROP TABLE probes;--", "'; SELECT 1; --", "%s%s%n", "{}", "[]", "true"]
HOSTILE_NAMES = ["daemon", "", "../x", "a/b", "-x", "x" * 65, "ok name", "\u00e9t\u00e9",
                 ".", "a;DROP TABLE probes"]


def seeds(data: Path | None) -> dict[str, str]:
    """A few dozen real rows (header included) of each format."""
    out = dict(FALLBACK)
    out["csv"] = GENERIC
    if data is not None:
        files = {"gpperf-cutlass": "gpperf/cutlass_rtx4070_results_clean.csv",
                 "gpperf-tiled": "gpperf/execution_times_all.csv",
                 "gpperf-tiled-power": "gpperf/power_usage_results_all.csv",
                 "b200": "b200/b200_gemm_fp8.csv", "xla": "xla/xla_matmul_perf_table_latest.csv"}
        for fmt, rel in files.items():
            p = data / rel
            if p.is_file():
                with p.open(encoding="utf-8", errors="replace") as f:
                    lines = [next(f, "") for _ in range(40)]
                out[fmt] = "".join(lines)
    return out


def _fields(line: str) -> list[str]:
    try:
        return next(csv.reader([line])) if line.strip() else []
    except csv.Error:  # an earlier edit already broke this line
        return []


def mutate(r: random.Random, text: str) -> bytes:
    """One or more damaging edits of a valid file."""
    lines = text.splitlines(keepends=True)
    for _ in range(r.randint(1, 3)):
        op = 0 if r.random() < 0.5 else r.randrange(14)  # mostly a plausible row, a bad value
        if not lines:
            lines = [""]
        i = r.randrange(len(lines))
        if op == 0:  # a hostile value in a random field
            f = _fields(lines[i])
            if f:
                f[r.randrange(len(f))] = r.choice(HOSTILE)
                buf = io.StringIO()
                csv.writer(buf, lineterminator="\n").writerow(f)
                lines[i] = buf.getvalue()
        elif op == 1:  # a hostile value unquoted, raw
            f = lines[i].rstrip("\n").split(",")
            f[r.randrange(len(f))] = r.choice(HOSTILE)
            lines[i] = ",".join(f) + "\n"
        elif op == 2:
            del lines[i]
        elif op == 3:
            lines.insert(r.randrange(len(lines) + 1), lines[i])
        elif op == 4:  # fields added or removed
            f = lines[i].rstrip("\n").split(",")
            if r.random() < 0.5 and len(f) > 1:
                del f[r.randrange(len(f))]
            else:
                f.insert(r.randrange(len(f) + 1), r.choice(HOSTILE + ["x"]))
            lines[i] = ",".join(f) + "\n"
        elif op == 5:  # header damage
            h = lines[0].rstrip("\n").split(",")
            j = r.randrange(len(h))
            h[j] = r.choice(["", h[j].upper(), h[j] + " (ms)", h[(j + 1) % len(h)], "runtime",
                             "time(furlongs)", "power_W", "m", r.choice(HOSTILE)])
            lines[0] = ",".join(h) + "\n"
        elif op == 6:  # truncated mid-byte stream
            s = "".join(lines)
            lines = [s[:r.randrange(len(s) + 1)]]
        elif op == 7:
            lines[i] = lines[i].replace(",", r.choice([";", "\t", " , ", ",,", '","']))
        elif op == 8:
            lines[i] = lines[i][:r.randrange(len(lines[i]) + 1)] + '"' + \
                lines[i][r.randrange(len(lines[i]) + 1):]
        elif op == 9:  # a very long field
            f = lines[i].rstrip("\n").split(",")
            f[r.randrange(len(f))] = "9" * r.choice([400, 10_000, 200_000])
            lines[i] = ",".join(f) + "\n"
        elif op == 10:
            lines = lines[:1]  # header only
        elif op == 11:
            s = "".join(lines)
            lines = [s.replace("\n", r.choice(["\r\n", "\r", "\n\n", "\x00\n"]))]
        elif op == 12:  # random characters inserted
            s = lines[i]
            j = r.randrange(len(s) + 1)
            lines[i] = s[:j] + "".join(chr(r.randint(0, 0x10FFF)) for _ in range(r.randint(1, 6))) \
                + s[j:]
        else:  # many columns
            lines[0] = lines[0].rstrip("\n") + "".join(f",c{j}" for j in range(5000)) + "\n"
    data = "".join(lines).encode("utf-8", errors="surrogatepass")
    roll = r.random()
    if roll < 0.05:
        data = b"\xef\xbb\xbf" + data
    elif roll < 0.08:
        data = "".join(lines).encode("utf-16", errors="replace")
    elif roll < 0.12:  # raw bytes at a random place
        j = r.randrange(len(data) + 1)
        data = data[:j] + bytes(r.randrange(256) for _ in range(r.randint(1, 64))) + data[j:]
    return data


def garbage(r: random.Random, seed_text: str) -> bytes:
    roll = r.randrange(8)
    if roll == 0:
        return b""
    if roll == 1:
        return bytes(r.randrange(256) for _ in range(r.choice([1, 100, 10_000])))
    if roll == 2:
        import gzip

        return gzip.compress(seed_text.encode())
    if roll == 3:
        return b"PK\x03\x04" + bytes(r.randrange(256) for _ in range(500))
    if roll == 4:
        return b"\n" * r.randint(1, 1000)
    if roll == 5:
        return b"SQLite format 3\x00" + bytes(4080)
    if roll == 6:
        return ("a," * 100_000 + "\n").encode()
    return (",".join(r.choice(HOSTILE) for _ in range(8)) + "\n").encode() * r.randint(1, 50)


@dataclass
class ImportStats:
    cases: int = 0
    imported: int = 0
    refused: int = 0
    tracebacks: int = 0
    hangs: int = 0
    half_imports: int = 0  # rows added by a failed run, or not the count a good run reported
    messy: int = 0  # failed without a `gemmd:` line, or with more than 5 lines
    max_s: float = 0.0
    rows_added: int = 0
    implausible: int = 0  # stored rows with a size or measurement no GEMM can have
    errors: collections.Counter = field(default_factory=collections.Counter)
    failures: list[str] = field(default_factory=list)


def _error_kind(line: str) -> str:
    s = re.sub(r"/\S+", "FILE", line)
    s = re.sub(r"\d+", "N", s)
    return s[:70]


def import_campaign(n: int, r: random.Random, work: Path, data: Path | None,
                    timeout: float, save: Path | None) -> ImportStats:
    st = ImportStats()
    state = work / "import-state"
    db = state / "gemmd.db"
    texts = seeds(data)
    # the store exists first (so that every case is compared with its rows)
    first = work / "imp-seed.csv"
    first.write_text(texts["csv"])
    base = gemmd("import", "--state-dir", str(state), "--name", "seed", str(first),
                 timeout=timeout)
    if base.rc != 0:
        raise RuntimeError(f"a valid import failed: {base.err.strip()[-300:]}")
    for i in range(n):
        case = work / f"imp-{i}.csv"
        args = ["import", "--state-dir", str(state)]
        roll = r.random()
        name_seed = r.choice(sorted(texts))
        special = None
        if roll < 0.70:
            case.write_bytes(mutate(r, texts[name_seed]))
        elif roll < 0.88:
            case.write_bytes(garbage(r, texts[name_seed]))
        elif roll < 0.93:
            case.write_bytes(texts[name_seed].encode())  # valid: must import exactly
        else:
            special = r.choice(["dir", "fifo", "devzero", "dangling", "missing", "big"])
            if special == "dir":
                case.mkdir()
            elif special == "fifo":
                os.mkfifo(case)
            elif special == "devzero":
                case.symlink_to("/dev/zero")
            elif special == "dangling":
                case.symlink_to(work / "nowhere.csv")
            elif special == "big":  # 30 MB: one endless header line, or rows of junk
                with case.open("w") as f:
                    if r.random() < 0.5:
                        f.write("m," * 15_000_000)
                    else:
                        f.write("m,n,k,dtype,runtime_ms\n" + "1,2\n" * 7_500_000)
        fmt = r.choice(["auto"] * 5 + list(FORMATS))
        if fmt != "auto" or r.random() < 0.3:
            args += ["--format", fmt]
        if r.random() < 0.25:
            args += ["--gpu", r.choice(["h100-sxm", "NVIDIA H100 80GB HBM3", "b200", "A10G",
                                        "rtx4070", "", "no-such-gpu", "sm_90"])]
        name = f"case{i}" if r.random() < 0.9 else r.choice(HOSTILE_NAMES)
        args += ["--name", name, str(case)]
        before = db_rows(db)[0]
        res = gemmd(*args, timeout=timeout)
        after = db_rows(db)[0]
        st.cases += 1
        st.max_s = max(st.max_s, res.seconds)
        bad = ""
        if res.hung:
            st.hangs += 1
            bad = "hang"
        elif res.traceback or res.rc not in (0, 1, 2):
            st.tracebacks += 1
            bad = "traceback"
        elif res.rc == 0:
            m = re.search(r"imported ([\d,]+) rows", res.out)
            reported = int(m[1].replace(",", "")) if m else -1
            if after - before != reported:
                st.half_imports += 1
                bad = f"reported {reported} rows, added {after - before}"
            else:
                st.imported += 1
                st.rows_added += reported
        else:
            lines = res.error_lines
            if after != before:
                st.half_imports += 1
                bad = f"failed (exit {res.rc}) but added {after - before} rows"
            elif not lines or len(res.err.strip().splitlines()) > 5:
                st.messy += 1
                bad = "failure without a one-line gemmd: error"
            else:
                st.refused += 1
                st.errors[_error_kind(lines[0])] += 1
        if bad:
            st.failures.append(f"import case {i} ({special or fmt}): {bad}: "
                               f"{(res.err or res.out).strip()[-300:]}")
            if save is not None:
                save.mkdir(parents=True, exist_ok=True)
                if case.is_file() and not case.is_symlink() and case.stat().st_size < 10**7:
                    shutil.copy(case, save / f"import-{i}.csv")
        if case.is_dir() and not case.is_symlink():
            case.rmdir()
        else:
            case.unlink(missing_ok=True)
    con = sqlite3.connect(db)
    ok = con.execute("PRAGMA integrity_check").fetchone()[0]
    # what went in must be physical: positive finite sizes and measurements
    st.implausible = con.execute(
        "SELECT COUNT(*) FROM probes WHERE source != 'seed' AND (m <= 0 OR n <= 0 OR k <= 0 "
        "OR NOT (runtime_s > 0 AND runtime_s < 1e6) AND runtime_s IS NOT NULL "
        "OR NOT (power_w > 0 AND power_w < 1e5) AND power_w IS NOT NULL "
        "OR NOT (energy_j > 0 AND energy_j < 1e9) AND energy_j IS NOT NULL)").fetchone()[0]
    con.close()
    if st.implausible:
        st.failures.append(f"{st.implausible} imported rows with a non-positive, infinite or "
                           "absurd size or measurement")
    if ok != "ok":
        st.failures.append(f"store after the import campaign: integrity_check {ok}")
    status = gemmd("status", "--state-dir", str(state), timeout=timeout)
    if status.rc != 0 or status.traceback:
        st.failures.append(f"gemmd status after the campaign: exit {status.rc}: "
                           f"{status.err.strip()[-300:]}")
    return st


# ------------------------------------------------------------------ kill -9


@dataclass
class KillStats:
    kills: int = 0
    in_flight: int = 0
    lost_rows: int = 0
    committed: int = 0
    missing_warnings: int = 0
    tracebacks: int = 0
    restart_s: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)


def kill_campaign(n: int, r: random.Random, work: Path, timeout: float) -> KillStats:
    st = KillStats()
    state, port = work / "kill-state", free_port()
    conf = daemon_config(work / "kill.yaml", state, port, realtime=True, window_s=0.3)
    db = state / "gemmd.db"
    checks: list[tuple[int, int]] = []  # (max id, rows with id <= it) seen before each kill
    logs = work / "kill-logs"
    logs.mkdir(exist_ok=True)
    for i in range(n + 1):
        log = logs / f"run-{i}.log"
        with log.open("wb") as f:
            t0 = time.monotonic()
            p = subprocess.Popen([*GEMMD, "run", "--config", str(conf)], stdout=f,
                                 stderr=subprocess.STDOUT)
        try:
            while get(port, "/metrics", 1.0) is None:
                if p.poll() is not None or time.monotonic() - t0 > timeout:
                    raise RuntimeError(f"daemon did not serve (exit {p.poll()}); log {log}")
                time.sleep(0.02)
            if i:
                st.restart_s.append(time.monotonic() - t0)
            if i == n:  # the last start only checks what the kills left
                break
            # wait for new committed rows, then kill at a random moment of probing
            start_rows = db_rows(db)[0] if db.exists() else 0
            deadline = time.monotonic() + timeout
            while (db_rows(db)[0] if db.exists() else 0) < start_rows + 1:
                if time.monotonic() > deadline:
                    raise RuntimeError("no probe committed")
                time.sleep(0.05)
            time.sleep(r.uniform(0.0, 1.5))
            flying, until = False, time.monotonic() + 5.0
            while not flying and time.monotonic() < until:  # aim inside a probe
                body = get(port, "/metrics", 1.0) or ""
                flying = metric(body, "gemmd_device_probe_in_flight_seconds") > 0
            time.sleep(r.uniform(0.0, 0.2))
            rows, mx = db_rows(db)
            p.send_signal(signal.SIGKILL)
            p.wait(timeout=10)
            st.kills += 1
            st.in_flight += flying
            checks.append((mx, rows))
        finally:
            if p.poll() is None and i == n:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
            elif p.poll() is None:
                p.kill()
                p.wait()
    con = sqlite3.connect(db)
    try:
        integrity = con.execute("PRAGMA integrity_check").fetchone()[0]
        for mx, rows in checks:
            have = con.execute("SELECT COUNT(*) FROM probes WHERE id <= ?", (mx,)).fetchone()[0]
            st.lost_rows += max(0, rows - have)
        st.committed = con.execute("SELECT COUNT(*) FROM probes").fetchone()[0]
    finally:
        con.close()
    if integrity != "ok":
        st.failures.append(f"integrity_check after the kills: {integrity}")
    for log in sorted(logs.iterdir()):
        text = log.read_text(errors="replace")
        st.tracebacks += text.count("Traceback (most recent call last)")
        st.missing_warnings += len(re.findall(r"probe results are missing", text))
    if st.lost_rows:
        st.failures.append(f"{st.lost_rows} committed rows lost after SIGKILLs")
    if st.tracebacks:
        st.failures.append(f"{st.tracebacks} tracebacks in the daemon's logs")
    if st.missing_warnings:
        st.failures.append(f"{st.missing_warnings} false 'missing' warnings after a SIGKILL")
    return st


# ------------------------------------------------------------------ store faults


@dataclass
class Case:
    fault: str
    command: str
    outcome: str  # "error", "warning", "ran", "traceback", "hang", "messy", "silent loss"
    detail: str


def make_store(state: Path, rows: int = 300, wal_only: int = 0) -> int:
    """A store with ``rows`` committed and checkpointed probe results, plus ``wal_only``
    more committed by a process then SIGKILLed (they are in the -wal only). Returns the
    rows committed in all."""
    state.mkdir(parents=True, exist_ok=True)
    script = f"""
import sys, time
sys.path.insert(0, {str(ROOT)!r})
from gemmd.store import Store
s = Store({str(state / 'gemmd.db')!r})
def rows(n, t0):
    return [{{"ts": t0 + i, "source": "daemon", "kind": "sentinel", "device_uuid": "GPU-a",
             "device_name": "x", "backend": "fake", "m": 64, "n": 64, "k": 64,
             "dtype": "fp32", "kernel": "blas", "tile": 0, "layout": "nn", "outcome": "ok",
             "runtime_s": 1e-3, "error": "e" * 100}} for i in range(n)]
s.insert_probes(rows({rows}, time.time() - 1000))
s._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
s._db.execute("PRAGMA wal_autocheckpoint=0")
for i in range({wal_only}):
    s.insert_probe(rows(1, time.time())[0])
print("committed", flush=True)
time.sleep(60)
"""
    p = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None
        line = p.stdout.readline()
        if "committed" not in line:
            raise RuntimeError("could not build a store")
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=10)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    return rows + wal_only


def run_daemon(conf: Path, port: int, seconds: float, timeout: float,
               plain_user: bool = False, fsize: int | None = None, on_serving: Any = None
               ) -> tuple[Run, bool]:
    """Start `gemmd run`; if it serves, let it run ``seconds`` (calling on_serving(elapsed)
    every second), then SIGTERM. (run, served)."""
    def pre() -> None:
        if fsize is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
        if plain_user:
            drop_dac()

    t0 = time.monotonic()
    p = subprocess.Popen([*GEMMD, "run", "--config", str(conf)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, errors="replace",
                         preexec_fn=pre if (plain_user or fsize is not None) else None,
                         start_new_session=True)
    served = False
    try:
        while time.monotonic() - t0 < timeout and p.poll() is None:
            if get(port, "/metrics", 1.0) is not None:
                served = True
                break
            time.sleep(0.05)
        if served:
            end = time.monotonic() + seconds
            while time.monotonic() < end and p.poll() is None:
                if on_serving is not None:
                    on_serving(time.monotonic() - t0)
                time.sleep(1.0)
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=timeout)
        return Run(["run"], p.returncode, out, err, time.monotonic() - t0), served
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        return Run(["run"], None, out, err, time.monotonic() - t0, hung=True), served


def judge(fault: str, command: str, res: Run, *, expect: str, committed: int | None,
          db: Path, served: bool = False, loss_words: tuple[str, ...] = ()) -> Case:
    """Classify one run. expect: 'error' (exit 1, one gemmd: line), 'warning' (a WARNING or
    ERROR log line containing one of loss_words, and the command works), 'either'."""
    if res.hung:
        return Case(fault, command, "hang", f"no exit in {res.seconds:.0f} s")
    if res.traceback or res.rc not in (0, 1, 2):
        return Case(fault, command, "traceback", (res.err or res.out).strip()[-400:])
    # the daemon logs "... WARNING name: text"; the other commands print the text alone
    logged = [ln for ln in res.err.splitlines() if ln.strip() and " INFO " not in ln
              and " DEBUG " not in ln]
    warned = [ln for ln in logged if any(w in ln for w in loss_words)] if loss_words else \
        [ln for ln in logged if " WARNING " in ln or " ERROR " in ln or res.args[0] != "run"]
    now = None
    with contextlib.suppress(sqlite3.Error, OSError):
        if db.is_file():
            now = db_rows(db)[0]
    lost = committed is not None and now is not None and now < committed
    if res.rc != 0:
        lines = res.error_lines
        if len(lines) != 1:
            return Case(fault, command, "messy", f"exit {res.rc}, {len(lines)} gemmd: lines: "
                        + res.err.strip()[-300:])
        return Case(fault, command, "error", lines[0][:220])
    if lost and not warned:
        return Case(fault, command, "silent loss", f"{committed - now} of {committed} rows "
                    "gone without a warning")
    if expect == "error":
        return Case(fault, command, "messy", "exit 0 where an error was expected: "
                    + (res.out + res.err).strip()[-300:])
    if warned:
        return Case(fault, command, "warning", re.sub(r"^\S+ \S+ [A-Z]+ ", "", warned[0])[:220])
    if expect == "warning" and (lost or committed is None):
        return Case(fault, command, "messy", "no warning: " + res.err.strip()[-300:])
    return Case(fault, command, "ran", "no loss, nothing to report" + (
        "" if served or command != "run" else " (did not serve)"))


def _damage_page(db: Path, r: random.Random) -> str:
    pages = db.stat().st_size // 4096
    page = r.randrange(1, pages) if pages > 1 else 0
    off = page * 4096 + r.choice([0, 8, 100, r.randrange(4096)])
    with db.open("r+b") as f:
        f.seek(off)
        f.write(bytes(r.randrange(256) for _ in range(r.choice([16, 512, 4096]))))
    return f"page {page}"


@contextlib.contextmanager
def tmpfs(path: Path, size: str):
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                       capture_output=True, text=True)
    if r.returncode:
        yield False
        return
    try:
        yield True
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def store_campaign(reps: int, r: random.Random, work: Path, timeout: float) -> list[Case]:
    cases: list[Case] = []
    k = 0

    def fresh(name: str) -> tuple[Path, Path, int]:
        nonlocal k
        k += 1
        state = work / f"store-{k}-{name}"
        port = free_port()
        conf = daemon_config(work / f"store-{k}.yaml", state, port)
        return state, conf, port

    def both(fault: str, state: Path, conf: Path, port: int, *, expect: str,
             committed: int | None, words: tuple[str, ...] = (), plain_user: bool = False,
             status_first: bool = True) -> None:
        db = state / "gemmd.db"
        if status_first:  # `gemmd status` must not repair or hide the damage either
            res = gemmd("status", "--state-dir", str(state), timeout=timeout,
                        plain_user=plain_user)
            cases.append(judge(fault, "status", res, expect=expect, committed=committed,
                               db=db, loss_words=words))
        res, served = run_daemon(conf, port, 2.0, timeout, plain_user=plain_user)
        cases.append(judge(fault, "run", res, expect=expect, committed=committed, db=db,
                           served=served, loss_words=words))

    for rep in range(reps):
        # 0-byte database (after data was written: the -seen mark says so)
        state, conf, port = fresh("zero")
        make_store(state)
        (state / "gemmd.db").write_bytes(b"")
        for p in ("gemmd.db-wal", "gemmd.db-shm"):
            (state / p).unlink(missing_ok=True)
        both("0-byte database", state, conf, port, expect="warning", committed=None,
             words=("0-byte", "missing"))
        # -wal deleted after a crash (its rows were committed, never checkpointed)
        state, conf, port = fresh("wal-deleted")
        n = make_store(state, rows=200, wal_only=r.randint(1, 150))
        for p in ("gemmd.db-wal", "gemmd.db-shm"):
            (state / p).unlink(missing_ok=True)
        both("-wal deleted after a crash", state, conf, port, expect="warning", committed=n,
             words=("missing",))
        # -wal garbled after a crash
        state, conf, port = fresh("wal-garbled")
        n = make_store(state, rows=200, wal_only=r.randint(1, 150))
        wal = state / "gemmd.db-wal"
        size = wal.stat().st_size
        with wal.open("r+b") as f:
            where = r.choice([0, 32, r.randrange(max(1, size))])
            f.seek(min(where, max(0, size - 1)))
            f.write(bytes(r.randrange(256) for _ in range(r.choice([8, 64, 4096]))))
        (state / "gemmd.db-shm").unlink(missing_ok=True)
        both("-wal garbled after a crash", state, conf, port, expect="either", committed=n,
             words=("missing",))
        # a malformed page
        state, conf, port = fresh("page")
        n = make_store(state, rows=r.choice([300, 3000]))
        what = _damage_page(state / "gemmd.db", r)
        both(f"malformed page ({what})" if rep == 0 else "malformed page", state, conf, port,
             expect="either", committed=n)
        # not a database at all, and one from a newer gemmd
        state, conf, port = fresh("garbage")
        state.mkdir(parents=True)
        (state / "gemmd.db").write_bytes(bytes(r.randrange(256) for _ in range(8192)))
        both("garbage file as the database", state, conf, port, expect="error",
             committed=None)
        state, conf, port = fresh("newer")
        make_store(state)
        con = sqlite3.connect(state / "gemmd.db")
        con.execute("PRAGMA user_version=99")
        con.close()
        both("database of a newer gemmd", state, conf, port, expect="error", committed=None)
        # each table dropped
        for table in ("probes", "devices", "models"):
            state, conf, port = fresh(f"drop-{table}")
            make_store(state)
            con = sqlite3.connect(state / "gemmd.db")
            con.execute(f"DROP TABLE {table}")
            con.commit()
            con.close()
            both(f"dropped table {table}", state, conf, port, expect="error", committed=None)
        # read-only database file (gemmd without root's power to ignore file modes)
        state, conf, port = fresh("ro-file")
        make_store(state)
        for p in state.iterdir():
            os.chmod(p, 0o444)
        both("read-only database file", state, conf, port, expect="error", committed=None,
             plain_user=True)
        # read-only filesystem
        state, conf, port = fresh("ro-fs")
        with tmpfs(state, "16m") as mounted:
            if mounted:
                make_store(state)
                subprocess.run(["mount", "-o", "remount,ro", str(state)], check=True)
                both("read-only filesystem", state, conf, port, expect="error",
                     committed=None)
        # full disk while running, and at start
        cases.extend(disk_full(work, r, timeout, rep))
    return cases


def disk_full(work: Path, r: random.Random, timeout: float, rep: int) -> list[Case]:
    out: list[Case] = []
    state, port = work / f"full-{rep}", free_port()
    conf = daemon_config(work / f"full-{rep}.yaml", state, port)
    db = state / "gemmd.db"
    with tmpfs(state, "3m") as mounted:
        fsize = None
        if not mounted:  # a size limit on every file the daemon writes instead
            state.mkdir(parents=True, exist_ok=True)
            fsize = 2 << 20
        seen: dict[str, float] = {}

        def watch(_elapsed: float) -> None:
            body = get(port, "/metrics", 2.0) or ""
            seen["errors"] = metric(body, "gemmd_store_errors_total")
            seen["ok"] = metric(body, "gemmd_probes_total", outcome="ok")

        # fill the filesystem except for ~200 KB, then run: the store fills it
        if mounted:
            filler = state / "filler"
            with filler.open("wb") as f:
                with contextlib.suppress(OSError):
                    f.write(b"\0" * (3 * 2**20 - 600 * 1024))
        res, served = run_daemon(conf, port, 25.0, timeout + 30, fsize=fsize, on_serving=watch)
        rows = db_rows(db)[0] if db.is_file() else 0
        logged = [ln for ln in res.err.splitlines() if " ERROR " in ln or " WARNING " in ln]
        full_lines = [ln for ln in logged if "full" in ln.lower() or "too large" in ln.lower()
                      or "File too large" in ln]
        if res.hung:
            out.append(Case("full disk while running", "run", "hang", ""))
        elif res.traceback:
            out.append(Case("full disk while running", "run", "traceback", res.err[-400:]))
        elif not served:
            lines = res.error_lines
            out.append(Case("full disk while running", "run",
                            "error" if len(lines) == 1 else "messy",
                            (lines or [res.err.strip()[-200:]])[0][:220]))
        elif seen.get("errors", 0) > 0 and full_lines and res.rc == 0:
            out.append(Case("full disk while running", "run", "warning",
                            f"{len(full_lines)} line(s) for {seen['errors']:.0f} results not "
                            f"stored ({rows} stored, {seen.get('ok', 0):.0f} probed); "
                            f"first: {full_lines[0].split(' ', 3)[-1][:150]}"))
        elif seen.get("errors", 0) > 0:
            out.append(Case("full disk while running", "run", "silent loss",
                            f"{seen['errors']:.0f} results not stored, no log line"))
        else:
            out.append(Case("full disk while running", "run", "ran",
                            f"the disk never filled ({rows} rows stored)"))
        # start on a disk that is already full (the store cannot even grow its -wal)
        if mounted:
            with (state / "filler2").open("wb") as f:
                with contextlib.suppress(OSError):
                    f.write(b"\0" * (8 << 20))
        res, served = run_daemon(conf, port, 3.0, timeout, fsize=fsize)
        out.append(judge("full disk at start", "run", res, expect="either", committed=None,
                         db=db, served=served))
        res = gemmd("status", "--state-dir", str(state), timeout=timeout, fsize=fsize)
        out.append(judge("full disk at start", "status", res, expect="either", committed=None,
                         db=db))
    return out


# ------------------------------------------------------------------ report


# ------------------------------------------------------- values (issue 24)

# (cell, the value it means in ms or None: must be refused), for the 0.012 ms of row 1.
VALUE_FORMS = [
    ("0.012", 0.012), ("+0.012", 0.012), (".012", 0.012), ("1.2e-2", 0.012),
    ("1.2E-2", 0.012), ("0.0120", 0.012), ("12e-3", 0.012), (" 0.012 ", 0.012),
    ('"0,012"', None), ("0_012", None), ("\uff10.\uff10\uff11\uff12", None),
    ("\u0660.\u0660\u0661\u0662", None), ('"0,012,0"', None), ("1.2e300", None),
    ("1e9999", None), ("inf", None), ("0x1p-7", None), ("1.2.3", None), ("\u22120.012", None),
    ("0.012ms", None), ("1.2e+3600", None), ("12_000e-6", None)]
# Headers with two columns for one quantity: (header, runtime ms of row 1 or None).
HEADER_FORMS = [("time_ms,time_s", None), ("runtime_ms,latency_us", None),
                ("mean_time_ms,avg_time_us", None), ("median_time_ms,mean_time_us", 0.012),
                ("runtime_ms,runtime_ms", None)]


@dataclass
class ValueStats:
    cases: int = 0
    clean: int = 0
    wrong_value: int = 0  # imported, but a stored number differs from the file's
    accepted_bad: int = 0  # a form that must be refused was imported
    refused_good: int = 0
    messy: int = 0
    failures: list[str] = field(default_factory=list)


def _stored_runtime(db: Path, source: str) -> list[float]:
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10)
    try:
        return [r[0] for r in con.execute(
            "SELECT runtime_s FROM probes WHERE source = ? ORDER BY id", (source,))]
    finally:
        con.close()


def values_campaign(n: int, r: random.Random, work: Path, timeout: float) -> ValueStats:
    """Numbers in imported files, checked in the store: a file that imports must store
    exactly what it says; a number gemmd cannot read for sure must be refused."""
    st = ValueStats()
    state = work / "values"
    state.mkdir(exist_ok=True)
    lines = GENERIC.splitlines()
    expected = [float(ln.split(",")[6]) * 1e-3 for ln in lines[1:]]
    cases = [("cell", f, v) for f, v in VALUE_FORMS] + [("header", h, v)
                                                         for h, v in HEADER_FORMS]
    cases = [c for c in cases for _ in (0, 1)]  # each with and without power and energy
    cases += [r.choice(cases) for _ in range(max(0, n - len(cases)))]
    for i, (what, form, value) in enumerate(cases):
        st.cases += 1
        rows = [ln.split(",") for ln in lines]
        if what == "cell":
            rows[1][6] = form
            head = ",".join(rows[0])
        else:
            heads = form.split(",")
            head = ",".join(rows[0][:6] + heads + rows[0][7:])
            for row in rows[1:]:  # the second column: the first's value in its unit
                f = {"s": 1e-3, "us": 1e3, "ms": 1.0}[heads[1].rsplit("_", 1)[1]]
                row[6:7] = [row[6], f"{float(row[6]) * f:.9g}"]
        text = head + "\n" + "\n".join(",".join(x) for x in rows[1:]) + "\n"
        if i % 2:  # without power and energy: no consistency check to catch a wrong time
            text = "\n".join(",".join(ln.split(",")[:-2]) for ln in text.splitlines()) + "\n"
        f_csv = work / f"value-{i}.csv"
        f_csv.write_text(text, encoding="utf-8")
        name = f"v{i}"
        res = gemmd("import", "--state-dir", str(state), "--format", "csv", "--name", name,
                    str(f_csv), timeout=timeout)
        f_csv.unlink()
        if res.traceback or res.hung or res.rc not in (0, 1, 2):
            st.messy += 1
            st.failures.append(f"{form!r}: rc {res.rc} {res.err[-200:]!r}")
            continue
        stored = _stored_runtime(state / "gemmd.db", name) if res.rc == 0 else []
        if value is None:
            if res.rc == 0:
                st.accepted_bad += 1
                st.failures.append(f"{what} {form!r} imported: stored {stored[:1]}")
            elif len(res.error_lines) != 1 or stored:
                st.messy += 1
                st.failures.append(f"{form!r}: {res.err[-200:]!r}")
            else:
                st.clean += 1
            continue
        if res.rc != 0:
            st.refused_good += 1
            st.failures.append(f"{what} {form!r} refused: {res.err.strip()[-200:]}")
            continue
        want = [value * 1e-3] + expected[1:]
        if len(stored) != len(want) or any(abs(a - b) > 1e-9 * b for a, b in
                                           zip(stored, want)):
            st.wrong_value += 1
            st.failures.append(f"{what} {form!r}: stored {stored[:2]}, the file says "
                               f"{want[:2]}")
        else:
            st.clean += 1
    return st


# ---------------------------------------- peers: a second daemon, the file, the clock

FAKETIME = next((p for p in ("/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1",
                             "/usr/lib/aarch64-linux-gnu/faketime/libfaketime.so.1",
                             "/usr/lib/faketime/libfaketime.so.1") if Path(p).exists()), None)


class Daemon:
    """`gemmd run` in the background, its log in a file."""

    def __init__(self, conf: Path, port: int, log: Path, env: dict[str, str] | None = None):
        self.port, self.log = port, log
        with log.open("wb") as f:
            self.proc = subprocess.Popen([*GEMMD, "run", "--config", str(conf)], stdout=f,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env={**os.environ, **(env or {})},
                                         start_new_session=True)

    def wait_serving(self, timeout: float) -> bool:
        end = time.monotonic() + timeout
        while time.monotonic() < end and self.proc.poll() is None:
            if get(self.port, "/metrics", 1.0) is not None:
                return True
            time.sleep(0.1)
        return False

    def metric(self, name: str) -> float:
        body = get(self.port, "/metrics", 5.0)
        return metric(body, name) if body else float("nan")

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self, timeout: float) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            return None


def _wait(pred: Any, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.2)
    return False


def peers_campaign(reps: int, work: Path, timeout: float) -> list[Case]:
    out: list[Case] = []
    for rep in range(reps):
        base = work / f"peers-{rep}"
        base.mkdir()
        out += _second_daemon(base, timeout)
        out += _file_gone(base, timeout, replace=False)
        out += _file_gone(base, timeout, replace=True)
        if FAKETIME:
            for jump in ("-1d", "+100d", "-2h", "+30m"):
                out += _clock(base, timeout, jump)
    return out


def _second_daemon(base: Path, timeout: float) -> list[Case]:
    state = base / "second"
    port, port2 = free_port(), free_port()
    a = Daemon(daemon_config(base / "a.json", state, port, gpus=1), port, base / "a.log")
    try:
        if not a.wait_serving(timeout):
            return [Case("second daemon", "run", "messy", f"A did not start: {a.text()[-300:]}")]
        n0 = db_rows(state / "gemmd.db")[0]
        res = gemmd("run", "--config", str(daemon_config(base / "b.json", state, port2, gpus=1)),
                    timeout=timeout)
        served = get(port, "/-/healthy") is not None
        if res.hung:
            return [Case("second daemon", "run", "hang", "B never exited")]
        line = " ".join(res.error_lines)
        ok = res.rc == 1 and len(res.error_lines) == 1 and \
            f"in use by another gemmd (pid {a.proc.pid} " in line and served
        return [Case("second daemon", "run", "error" if ok else "messy",
                     f"{line[:160]} (A still serving: {served}; A's rows {n0} -> "
                     f"{db_rows(state / 'gemmd.db')[0]})")]
    finally:
        a.stop(timeout)


def _file_gone(base: Path, timeout: float, replace: bool) -> list[Case]:
    fault = "gemmd.db replaced while running" if replace else "gemmd.db* deleted while running"
    state = base / ("replaced" if replace else "deleted")
    port = free_port()
    d = Daemon(daemon_config(base / f"{state.name}.json", state, port, gpus=1), port,
               base / f"{state.name}.log")
    try:
        db = state / "gemmd.db"
        if not d.wait_serving(timeout) or not _wait(lambda: db_rows(db)[0] >= 3, timeout):
            return [Case(fault, "run", "messy", f"no rows: {d.text()[-300:]}")]
        n0 = db_rows(db)[0]
        if replace:
            other = state / "other.db"
            con = sqlite3.connect(other)
            con.execute("CREATE TABLE x (y)")
            con.close()
            os.replace(other, db)
        else:
            for p in state.glob("gemmd.db*"):
                p.unlink()
        time.sleep(12)  # the watchdog looks every 5 s
    finally:
        rc = d.stop(timeout)
    text = d.text()
    if rc is None or "Traceback" in text:
        return [Case(fault, "run", "hang" if rc is None else "traceback", text[-300:])]
    if replace:
        n = text.count("was replaced by another file")
        return [Case(fault, "run", "warning" if n == 1 else "silent loss" if n == 0 else "messy",
                     f"logged {n} time(s)")]
    n1 = db_rows(db)[0] if db.exists() else 0
    said = "was deleted while gemmd runs: written back" in text
    outcome = "warning" if said and n1 >= n0 else "silent loss"
    return [Case(fault, "run", outcome, f"{n0} rows before, {n1} in gemmd.db after stop; "
                 f"{'logged' if said else 'NOT logged'}")]


def _clock(base: Path, timeout: float, jump: str) -> list[Case]:
    """A wall-clock jump under libfaketime (the monotonic clock untouched): the probe
    rounds go on, the log says so once, gemmd_clock_jumps_total counts it, and retention
    (refits every 10 s, retention 90 days) deletes nothing."""
    fault = f"wall clock {jump}"
    state = base / f"clock{jump}"
    port = free_port()
    conf = base / f"clock{jump}.json"
    daemon_config(conf, state, port, gpus=1)
    cfg = json.loads(conf.read_text())
    cfg["schedule"]["refit_interval_s"] = 10
    cfg["store"] = {"retention_days": 90}
    conf.write_text(json.dumps(cfg))
    stamp = base / f"faketime{jump}"
    stamp.write_text("+0\n")
    d = Daemon(conf, port, base / f"clock{jump}.log",
               env={"LD_PRELOAD": str(FAKETIME), "FAKETIME_TIMESTAMP_FILE": str(stamp),
                    "FAKETIME_NO_CACHE": "1", "FAKETIME_DONT_FAKE_MONOTONIC": "1",
                    "FAKETIME_DONT_RESET": "1",
                    # file times untouched: faked ones made Python recompile every module
                    # it imported after the jump (scikit-learn at the first refit: 20 s)
                    "NO_FAKE_STAT": "1"})
    try:
        if not d.wait_serving(timeout) or not _wait(
                lambda: d.metric("gemmd_device_rounds_total") >= 3, timeout):
            return [Case(fault, "run", "messy", f"no rounds: {d.text()[-300:]}")]
        n0 = db_rows(state / "gemmd.db")[0]
        r0 = d.metric("gemmd_device_rounds_total")
        stamp.write_text(jump + "\n")
        time.sleep(15)  # 1 s rounds; the daemon looks every 5 s; a refit every 10 s
        rounds = d.metric("gemmd_device_rounds_total") - r0
        jumps = d.metric("gemmd_clock_jumps_total")
        n1 = db_rows(state / "gemmd.db")[0]
    finally:
        rc = d.stop(timeout)
    text = d.text()
    said = text.count("wall clock jumped")
    ok = rounds >= 5 and jumps == 1 and said == 1 and n1 >= n0 and rc is not None
    return [Case(fault, "run", "warning" if ok else "silent loss" if n1 < n0 else "messy",
                 f"{rounds:.0f} rounds in the 15 s after; gemmd_clock_jumps_total {jumps:g}; "
                 f"logged {said}x; rows {n0} -> {n1}")]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--imports", type=int, default=400)
    ap.add_argument("--kills", type=int, default=50)
    ap.add_argument("--store-reps", type=int, default=5)
    ap.add_argument("--values", type=int, default=80)
    ap.add_argument("--peer-reps", type=int, default=2)
    ap.add_argument("--only", default="import,kill,store,values,peers")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--save", type=Path, help="keep failing cases here")
    ap.add_argument("--keep", type=Path, help="work in this folder and keep it")
    args = ap.parse_args()
    from gemmd.datasets import shared_data_dir

    r = random.Random(args.seed)
    work = args.keep or Path(tempfile.mkdtemp(prefix="gemmd-faults-"))
    work.mkdir(parents=True, exist_ok=True)
    os.chmod(work, 0o755)
    only = set(args.only.split(","))
    failed = False
    t_all = time.monotonic()
    print(f"# fuzz_faults seed {args.seed}, {os.cpu_count()} cores, Python "
          f"{sys.version.split()[0]}, SQLite {sqlite3.sqlite_version}; work in {work}\n")
    if "import" in only:
        t0 = time.monotonic()
        st = import_campaign(args.imports, r, work, shared_data_dir(), args.timeout, args.save)
        print("| import: cases | imported (rows as reported) | refused with one line | "
              "tracebacks | hangs | half-imports | messy failures | implausible rows stored "
              "| slowest |")
        print("|---|---|---|---|---|---|---|---|---|")
        print(f"| {st.cases} | {st.imported} ({st.rows_added:,} rows) | {st.refused} | "
              f"{st.tracebacks} | {st.hangs} | {st.half_imports} | {st.messy} | "
              f"{st.implausible} | {st.max_s:.1f} s |")
        print(f"\n{time.monotonic() - t0:.0f} s. Most common refusals:")
        for kind, c in st.errors.most_common(12):
            print(f"  {c:4d}  {kind}")
        for f in st.failures[:30]:
            print("FAIL", f)
        failed |= bool(st.failures)
        print()
    if "kill" in only:
        t0 = time.monotonic()
        ks = kill_campaign(args.kills, r, work, args.timeout)
        rs = sorted(ks.restart_s) or [float("nan")]
        print("| kill -9: SIGKILLs | of them mid-probe | committed rows lost | rows at the end "
              "| false 'missing' warnings | tracebacks | restart to /metrics: median / p95 / "
              "max |")
        print("|---|---|---|---|---|---|---|")
        print(f"| {ks.kills} | {ks.in_flight} | {ks.lost_rows} | {ks.committed:,} | "
              f"{ks.missing_warnings} | {ks.tracebacks} | {statistics.median(rs):.2f} / "
              f"{rs[min(len(rs) - 1, int(0.95 * len(rs)))]:.2f} / {rs[-1]:.2f} s |")
        print(f"\n{time.monotonic() - t0:.0f} s.")
        for f in ks.failures:
            print("FAIL", f)
        failed |= bool(ks.failures)
        print()
    if "store" in only:
        t0 = time.monotonic()
        cases = store_campaign(args.store_reps, r, work, args.timeout)
        table: dict[tuple[str, str], collections.Counter] = {}
        example: dict[tuple[str, str], str] = {}
        for c in cases:
            key = (re.sub(r" \(page \d+\)", "", c.fault), c.command)
            table.setdefault(key, collections.Counter())[c.outcome] += 1
            example.setdefault(key, c.detail)
            if c.outcome in ("traceback", "hang", "messy", "silent loss"):
                example[key] = c.detail
                failed = True
        print("| store fault | command | runs | one-line error | logged warning | ran clean | "
              "traceback | hang | messy | silent loss | what it said |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for (fault, cmd), cnt in table.items():
            print(f"| {fault} | {cmd} | {sum(cnt.values())} | {cnt['error']} | "
                  f"{cnt['warning']} | {cnt['ran']} | {cnt['traceback']} | {cnt['hang']} | "
                  f"{cnt['messy']} | {cnt['silent loss']} | "
                  f"{example[(fault, cmd)].replace('|', '/')[:160]} |")
        print(f"\n{time.monotonic() - t0:.0f} s.")
    if "values" in only:
        t0 = time.monotonic()
        vs = values_campaign(args.values, r, work, args.timeout)
        print("| values: cases | clean | wrong value stored | must-refuse imported | "
              "valid refused | messy |\n|---|---|---|---|---|---|")
        print(f"| {vs.cases} | {vs.clean} | {vs.wrong_value} | {vs.accepted_bad} | "
              f"{vs.refused_good} | {vs.messy} |")
        print(f"\n{time.monotonic() - t0:.0f} s.")
        for f in vs.failures[:30]:
            print("FAIL", f)
        failed |= bool(vs.failures)
        print()
    if "peers" in only:
        t0 = time.monotonic()
        pc = peers_campaign(args.peer_reps, work, args.timeout)
        print("| peer or clock fault | runs | clean (refused or warned) | silent loss | hang | "
              "messy | what happened |\n|---|---|---|---|---|---|---|")
        groups: dict[str, list[Case]] = {}
        for c in pc:
            groups.setdefault(c.fault, []).append(c)
        for fault, cs in groups.items():
            cnt = collections.Counter(c.outcome for c in cs)
            bad = [c for c in cs if c.outcome not in ("error", "warning")]
            print(f"| {fault} | {len(cs)} | {cnt['error'] + cnt['warning']} | "
                  f"{cnt['silent loss']} | {cnt['hang']} | {cnt['messy'] + cnt['traceback']} | "
                  f"{(bad or cs)[0].detail.replace('|', '/')[:160]} |")
            failed |= bool(bad)
        if not FAKETIME:
            print("\n(no libfaketime: clock jumps not run; apt-get install faketime)")
        print(f"\n{time.monotonic() - t0:.0f} s.")
    print(f"\ntotal {time.monotonic() - t_all:.0f} s; {'FAILURES' if failed else 'clean'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
