"""Command-line fuzz of the real `gemmd` (issue 12): every option of every command, and the
positional arguments, given hostile values, run as subprocesses and counted.

    .venv/bin/python bench/fuzz_cli.py [-n 300] [--seed 0] [--all] [--timeout 120]
                                       [--jobs 3] [--list] [--save FILE]

The options are read from gemmd's own parser (gemmd.cli.build_parser), so a new option is
fuzzed without editing this file. Each option gets values from a pool chosen by its kind:

- numbers: 0, -1, nan, inf, 1e308, 4.9e-324, 65536, -10**12, 400 and 5,000 digits, hex,
  Arabic-Indic digits (Python's int() reads them), '', text;
- paths: '', /proc/..., /sys/..., /dev/zero, /dev/full, /dev/null, a directory, a path under
  a file, a missing directory, a 5,000-character name, a newline in the name, '-';
- shapes (MxNxK): zeros, negatives, too few or many dimensions, over the bound, nan;
- text: '', blanks, control characters, 10,000 characters, SQL and format-string payloads;
- choices: '', a wrong case, a missing value.

Cases are (command, its minimal valid arguments, one option with a hostile value), plus
random mixes (several hostile options at once, the common options before the command,
repeated and unknown options). Each runs `gemmd` in an empty working directory on a store
that holds an imported file and a fake GPU's probe round. A case passes when it ends with
exit 0, or with exit 1/2 and every stderr line either a `gemmd:` error or a log line; and
there is no traceback, no hang (--timeout), and no file left in the working directory (a
relative path given on the command line excepted). `run` cases that start are stopped
with SIGTERM 3 s after they report ready (READY=1 on $NOTIFY_SOCKET: the SIGTERM handler
is in place by then, however long the start took) and must exit 0.

Exit 0 on a hostile value is not counted as a failure (a value can be hostile to one
command and fine for another), but every such case is listed with what it printed, for a
person to review; the reviewed ones are listed in ACCEPTED below with the reason.
Figures, not assertions: exit status 1 if any case failed.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import itertools
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

_SCRIPT = Path(sys.executable).with_name("gemmd")
GEMMD = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "gemmd"]
DATA = ROOT.parent / "shared" / "data" / "gpperf" / "cutlass_rtx4070_results_clean.csv"
LOG_LEVELS = ("DEBUG ", "INFO ", "WARNING ", "ERROR ", "CRITICAL ")

# Placeholders, replaced per run: FILE a measurement file, MODEL a fitted model, DIR a
# directory, OUT a fresh output path in the scratch directory, SD the state directory.
NUMBERS: list[tuple[str, bool]] = [  # (value, hostile)
    ("1", False), ("0", True), ("-1", True), ("-0", True), ("nan", True), ("-inf", True),
    ("inf", True), ("1e308", True), ("4.9e-324", True), ("65536", True),
    ("-1000000000000", True), ("1" * 400, True), ("9" * 5000, True), ("0x10", True),
    ("\u0661\u0662", True), ("", True), ("abc", True), (" 7 ", False), ("1e12", True),
]
PATHS: list[tuple[str, bool]] = [
    ("", True), (" ", True), ("/proc/gemmd-fuzz", True), ("/sys/gemmd-fuzz", True),
    ("/dev/zero", True), ("/dev/full", True), ("/dev/null", True), ("DIR", True),
    ("FILE/under-a-file", True), ("NOSUCH/x", True), ("x" * 5000, True),
    ("bad\nname", True), ("-", True), ("OUT", False),
]
SHAPES: list[tuple[str, bool]] = [
    ("0x1x1", True), ("1x1", True), ("1x1x1x1", True), ("-1x2x2", True),
    ("1048577x1x1", True), ("nanxnanxnan", True), ("", True), ("1e3x1x1", True),
    ("99999999999999999999x1x1", True), ("64x64x64", False),
]
TEXT: list[tuple[str, bool]] = [
    ("", True), ("   ", True), ("a\nb", True), ("\x1b[31mred", True), ("x" * 10000, True),
    ("'; DROP TABLE results; --", True), ("%s%n%x", True), ("../../etc/passwd", True),
    ("0", True), ("NVIDIA H100 80GB HBM3", False),
]
CHOICES: list[tuple[str, bool]] = [("", True), ("BOGUS", True), ("-", True)]

# Minimal valid arguments per command (the case adds one hostile option to them).
BASE: dict[str, list[str]] = {
    "run": [],
    "check-config": [],
    "rebaseline": [],
    "probe": ["--no-store"],
    "status": [],
    "fit": ["FILE", "--out", "OUT.skops"],
    "evaluate": ["FILE", "--baseline", "none", "--split", "random"],
    "predict": ["1024", "1024", "1024", "--dtype", "fp32", "--model", "MODEL"],
    "advise": ["1024", "1024", "1024", "--model", "MODEL"],
    "import": ["FILE", "--name", "NAME"],
    "export": ["--out", "OUT.csv"],
    "prune": ["--source", "fuzz-nothing", "--all"],
    "report": ["--fleet", "--out", "OUT.html"],
}
PATH_DESTS = {"out", "model", "files", "file", "config", "state_dir", "web_config_file",
              "gpu_spec", "calibrate"}

# Hostile-looking values that gemmd rightly accepts, reviewed: (commands or None for all,
# option, values or None for all, why).
ANY = None
ACCEPTED: list[tuple[set[str] | None, str, set[str] | None, str]] = [
    ({"check-config", "fit", "evaluate", "predict", "advise", "probe"}, "--state-dir", ANY,
     "not used: the command reads no store (files, --model, --no-store) or only checks "
     "the value's form (check-config); run and import create a missing directory"),
    (ANY, "--state-dir", {"DIR", "NOSUCH/x", "-", "bad\nname"},
     "a directory that exists or can be made (a relative one in the working directory)"),
    (ANY, "--config", {"/dev/null"}, "an empty file is a valid configuration: the defaults"),
    ({"check-config"}, "file", {"/dev/null"}, "an empty file is a valid configuration"),
    (ANY, "*", {"\u0661\u0662"}, "Unicode decimal digits are read as the number 12"),
    ({"run"}, "--port", {"0", "-0"}, "0: any free port (documented)"),
    ({"run"}, "--web.config.file", {"", "/dev/null"},
     "empty (a name or a file): no TLS or authentication, as exporter-toolkit reads it"),
    ({"predict"}, "--alpha", ANY, "any finite number is a GEMM's alpha (nan, inf refused)"),
    ({"predict"}, "--beta", ANY, "any finite number is a GEMM's beta (nan, inf refused)"),
    ({"predict", "advise"}, "*", {"65536"}, "a valid size"),
    ({"fit", "export"}, "--out", {"bad\nname", "-", "/dev/null", "/dev/zero"},
     "a file name the user chose, written as given (export: '-' is stdout)"),
    ({"import", "prune", "export"}, "*", {"0"}, "'0' is a valid source name"),
    ({"predict", "advise"}, "--source", {"0"},
     "'0' is a valid source name; predict says its rows are outside the domain ('no 0 "
     "data on ...')"),
    ({"rebaseline", "predict", "advise", "report"}, "--device", {"0"}, "device index 0"),
    ({"report"}, "--days", {"4.9e-324"}, "a positive window: the report says it is empty"),
]


def reviewed(case: Case) -> str | None:
    """Why exit 0 is right for this hostile case, if it was reviewed (ACCEPTED)."""
    if not case.option:
        return None
    for commands, option, values, why in ACCEPTED:
        if (commands is None or case.command in commands) and option in ("*", case.option) \
                and (values is None or case.value in values):
            return why
    return None


@dataclass(frozen=True)
class Option:
    command: str
    flag: str  # '' for a positional argument
    dest: str
    kind: str  # number, path, shape, text, choice, flag
    positional_index: int | None = None


@dataclass
class Case:
    command: str
    argv: list[str]
    what: str  # the hostile part, for the report
    hostile: bool
    option: str = ""  # the one option (or positional name) a systematic case sets
    value: str = ""


def options() -> list[Option]:
    """Every option and positional argument of every command, from gemmd's parser."""
    from gemmd.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    out: list[Option] = []
    for command, p in sub.choices.items():
        pos = 0
        for a in p._actions:
            if isinstance(a, argparse._HelpAction):
                continue
            flag = max(a.option_strings, key=len) if a.option_strings else ""
            if a.nargs == 0:
                kind = "flag"
            elif a.choices:
                kind = "choice"
            elif a.dest in PATH_DESTS:
                kind = "path"
            elif getattr(a.type, "__name__", "") in ("shape", "cta"):
                kind = "shape"
            elif a.type in (int, float) or _numeric(a.type):
                kind = "number"
            else:
                kind = "text"
            out.append(Option(command, flag, a.dest, kind, None if flag else pos))
            pos += 0 if flag else 1
    return out


def _numeric(t) -> bool:
    try:
        return isinstance(t("1"), (int, float)) if t else False
    except Exception:  # noqa: BLE001 - a type that refuses "1" is not a number type
        return False


POOLS = {"number": NUMBERS, "path": PATHS, "shape": SHAPES, "text": TEXT, "choice": CHOICES}


def systematic() -> list[Case]:
    cases: list[Case] = []
    for o in options():
        base = list(BASE[o.command])
        if o.kind == "flag":
            cases.append(Case(o.command, [o.command, *base, o.flag], o.flag, False))
            continue
        for value, hostile in POOLS[o.kind]:
            if o.flag:
                argv = [o.command, *_without(base, o.flag), o.flag, value]
            else:
                argv = [o.command, *_replace_positional(o, base, value)]
            cases.append(Case(o.command, argv, f"{o.flag or o.dest} {value[:40]!r}", hostile,
                              o.flag or o.dest, value))
        if o.flag:  # the option with its value missing
            cases.append(Case(o.command, [o.command, *_without(base, o.flag), o.flag],
                              f"{o.flag} (no value)", True))
    return cases


def _without(base: list[str], flag: str) -> list[str]:
    """Base arguments minus `flag VALUE` (the case sets that option itself)."""
    out, skip = [], False
    for a in base:
        if skip:
            skip = False
            continue
        if a == flag:
            skip = True
            continue
        out.append(a)
    return out


def _replace_positional(o: Option, base: list[str], value: str) -> list[str]:
    positionals = [i for i, a in enumerate(base) if not a.startswith("-")
                   and (i == 0 or not base[i - 1].startswith("-"))]
    out = list(base)
    if o.positional_index is not None and o.positional_index < len(positionals):
        out[positionals[o.positional_index]] = value
    else:
        out.insert(0, value)
    return out


def mixed(r: random.Random, n: int) -> list[Case]:
    """Random mixes: several hostile values at once, common options before the command,
    repeated and unknown options, '--', a lone '-'."""
    by_command = collections.defaultdict(list)
    for o in options():
        by_command[o.command].append(o)
    cases = []
    for _ in range(n):
        command = r.choice(sorted(BASE))
        argv = list(BASE[command])
        parts = []
        for o in r.sample(by_command[command], min(len(by_command[command]), r.randint(2, 4))):
            if o.kind == "flag":
                argv.append(o.flag)
                parts.append(o.flag)
                continue
            value = r.choice(POOLS[o.kind])[0]
            if o.flag:
                argv = [*_without(argv, o.flag), o.flag, value]
            else:
                argv = _replace_positional(o, argv, value)
            parts.append(f"{o.flag or o.dest}={value[:20]!r}")
        front: list[str] = []
        extra = r.random()
        if extra < 0.25:  # common options before the command
            front = [r.choice(["--state-dir", "--config", "--log-level"]),
                     r.choice(["", "DIR", "/proc/x", "debug", "BOGUS"])]
            parts.append(f"before the command: {front}")
        elif extra < 0.4:
            argv.append(r.choice(["--bogus", "--", "-", "-x", "--out=", "--=", "---"]))
            parts.append(f"extra {argv[-1]!r}")
        elif extra < 0.5 and argv:
            argv += argv[-2:]  # the last option repeated
            parts.append("last option repeated")
        cases.append(Case(command, [*front, command, *argv], "; ".join(parts), True))
    return cases


# ------------------------------------------------------------------ running


@dataclass
class Result:
    case: Case
    rc: int | None
    out: str
    err: str
    seconds: float
    stray: list[str]
    hung: bool = False

    @property
    def failure(self) -> str | None:
        if self.hung:
            return "hang"
        if "Traceback (most recent call last)" in self.err + self.out:
            return "traceback"
        if self.rc not in (0, 1, 2):
            return f"exit {self.rc}"
        if self.rc != 0:
            lines = [ln for ln in self.err.splitlines() if ln.strip()]
            if not any(ln.startswith("gemmd:") for ln in lines):
                return "no gemmd: error line"
            odd = [ln for ln in lines if not ln.startswith("gemmd:") and not _log_line(ln)]
            if odd:
                return "stray stderr line: " + odd[0][:80]
        if self.stray:
            return "left files in the working directory: " + ", ".join(self.stray[:3])
        return None


def _log_line(line: str) -> bool:
    # "2026-11-23 10:00:00,123 INFO gemmd.x: message"
    return len(line) > 24 and line[4] == "-" and line[24:].startswith(LOG_LEVELS)


class Env:
    """A scratch directory with a config (fake GPUs), a store holding an imported file and
    one probe round, a fitted model, and an empty working directory per case."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.sd = root / "state"
        self.file = root / "cutlass.csv"
        self.dir = root / "adir"
        self.dir.mkdir()
        (root / "home").mkdir()
        self.model = root / "model.skops"
        self.config = root / "gemmd.yaml"
        self.config.write_text(json.dumps({
            "backend": "fake", "state_dir": str(self.sd),
            "listen": {"address": "127.0.0.1", "port": 0},
            "schedule": {"probe_interval_s": 2, "refit_interval_s": 3600},
            "budget": {"duty_cycle": 1.0},
            "model": {"min_samples": 15, "n_estimators": 20},
            "probes": {"measure": {"window_s": 0.2}}}))
        if DATA.exists():
            lines = DATA.read_text().splitlines()[:301]
        else:  # no shared data: generic rows
            lines = ["m,n,k,dtype,runtime_ms,gpu"] + [
                f"{s},{s},{s},fp32,{s ** 3 * 2e-9:.6f},NVIDIA GeForce RTX 4070"
                for s in range(256, 256 + 300 * 16, 16)]
        self.file.write_text("\n".join(lines) + "\n")
        for argv in (["import", str(self.file), "--name", "cutlass"],
                     ["probe"],
                     ["fit", str(self.file), "--out", str(self.model)]):
            p = subprocess.run([*GEMMD, *argv], capture_output=True, text=True, timeout=600,
                               env=self.environ())
            if p.returncode != 0:
                raise SystemExit(f"setup: gemmd {' '.join(argv)} failed: {p.stderr[-500:]}")
        self._ids = itertools.count(1)  # next() is atomic: cases run in threads

    def argv(self, case: Case, cwd: Path) -> list[str]:
        n = next(self._ids)
        subst = {"FILE": str(self.file), "MODEL": str(self.model), "DIR": str(self.dir),
                 "NAME": f"fuzz-{n}"}
        out = []
        for a in case.argv:
            if a.startswith("OUT"):
                a = str(self.root / f"out-{n}{a[3:]}")
            elif a.startswith("NOSUCH/"):  # a missing directory, in scratch (root makes it)
                a = str(self.root / f"nosuch-{n}") + a[6:]
            elif a.startswith("FILE/"):
                a = str(self.file) + a[4:]
            else:
                a = subst.get(a, a)
            out.append(a)
        return out

    def environ(self) -> dict[str, str]:
        """The config by $GEMMD_CONFIG (a fuzzed --config overrides it), HOME in scratch."""
        env = {k: v for k, v in os.environ.items() if k not in ("XDG_STATE_HOME",
                                                                 "STATE_DIRECTORY")}
        return {**env, "GEMMD_CONFIG": str(self.config), "HOME": str(self.root / "home")}


def run_case(env: Env, case: Case, timeout: float) -> Result:
    cwd = Path(tempfile.mkdtemp(dir=env.root, prefix="cwd-"))
    argv = env.argv(case, cwd)
    t0 = time.monotonic()
    if case.command == "run":
        rc, out, err, hung = _run_daemon(env, argv, cwd, timeout)
    else:
        p = subprocess.Popen([*GEMMD, *argv], cwd=cwd, env=env.environ(),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             stdin=subprocess.DEVNULL, text=True, errors="replace",
                             start_new_session=True)
        hung = False
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            out, err = p.communicate()
            hung = True
        rc = p.returncode
    seconds = time.monotonic() - t0
    relative = {a.split("/")[0] for a in argv if a and not a.startswith("/")}
    stray = sorted(x.name for x in cwd.iterdir() if x.name not in relative)
    shutil.rmtree(cwd, ignore_errors=True)
    return Result(case, None if hung else rc, out, err, seconds, stray, hung)


RUN_AFTER_READY_S = 3.0  # how long a started `gemmd run` probes before it is stopped
_READY_IDS = itertools.count(1)


def _run_daemon(env: Env, argv: list[str], cwd: Path, timeout: float
                ) -> tuple[int | None, str, str, bool]:
    """(exit status, stdout, stderr, hung) of `gemmd run ...`: it either exits, or reports
    READY=1 and is stopped with SIGTERM as systemd would. Stopping it at a fixed time
    instead raced its start: on a loaded machine a SIGTERM could come before the handler
    was installed (exit -15). Hung: neither within ``timeout``, or no stop within 30 s."""
    name = f"gemmd-fuzz-{os.getpid()}-{next(_READY_IDS)}"  # an abstract socket: no file
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as ready, \
            tempfile.TemporaryFile("w+", dir=env.root, errors="replace") as out, \
            tempfile.TemporaryFile("w+", dir=env.root, errors="replace") as err:
        ready.bind("\0" + name)
        ready.settimeout(0.1)
        p = subprocess.Popen([*GEMMD, *argv], cwd=cwd,
                             env={**env.environ(), "NOTIFY_SOCKET": "@" + name},
                             stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                             start_new_session=True)
        deadline, hung = time.monotonic() + timeout, False
        try:
            while p.poll() is None:
                try:
                    if b"READY=1" not in ready.recv(4096):
                        continue
                except TimeoutError:
                    if time.monotonic() > deadline:
                        raise subprocess.TimeoutExpired(p.args, timeout) from None
                    continue
                time.sleep(RUN_AFTER_READY_S)
                p.send_signal(signal.SIGTERM)
                p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            hung = True
        out.seek(0)
        err.seek(0)
        return p.returncode, out.read(), err.read(), hung


def _short(argv: list[str]) -> str:
    return " ".join(repr(a) if len(a) <= 60 else f"'{a[:20]}...' ({len(a)} chars)"
                    for a in argv)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", type=int, default=300, help="cases (default 300; --all: every "
                    "systematic case plus n//4 mixes)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--all", action="store_true")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds before a hang")
    ap.add_argument("--jobs", type=int, default=3, help="cases run at once (default 3)")
    ap.add_argument("--list", action="store_true", help="print the cases and stop")
    ap.add_argument("--save", type=Path, help="write every failing or accepted case as JSON")
    args = ap.parse_args()

    r = random.Random(args.seed)
    cases = systematic()
    if not args.all:
        r.shuffle(cases)
        cases = cases[: args.n - args.n // 4]
    cases += mixed(r, args.n // 4)
    if args.list:
        for c in cases:
            print(json.dumps(c.argv))
        return 0

    t0 = time.monotonic()
    counts: collections.Counter[str] = collections.Counter()
    failed: list[Result] = []
    accepted: list[Result] = []
    slowest: Result | None = None
    with tempfile.TemporaryDirectory(prefix="gemmd-fuzz-cli-") as tmp:
        env = Env(Path(tmp))
        print(f"{len(cases)} cases ({len(systematic())} systematic in all), "
              f"{len({c.command for c in cases})} commands; gemmd: {' '.join(GEMMD)}")
        with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
            results = pool.map(lambda c: run_case(env, c, args.timeout), cases)
            for i, res in enumerate(results):
                case, why = res.case, res.failure
                if slowest is None or res.seconds > slowest.seconds:
                    slowest = res
                if why:
                    counts[why.split(":")[0]] += 1
                    failed.append(res)
                    last = ((res.err or res.out).strip().splitlines() or [""])[-1]
                    print(f"FAIL {i}: {why[:120]}: gemmd {_short(case.argv)}\n"
                          f"     {last[:160]!r}", flush=True)
                else:
                    counts[f"exit {res.rc}"] += 1
                    if res.rc == 0 and case.hostile:
                        if reviewed(case):
                            counts["exit 0, hostile, reviewed"] += 1
                        else:
                            accepted.append(res)
    print(f"\n{len(cases)} cases in {time.monotonic() - t0:.0f} s: "
          + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    if slowest:
        print(f"slowest: {slowest.seconds:.1f} s: gemmd {_short(slowest.case.argv)}")
    print(f"failures: {len(failed)}")
    if accepted:
        print(f"\nexit 0 on a hostile value, {len(accepted)} cases not reviewed (see ACCEPTED):")
        for res in accepted:
            last = (res.out.strip().splitlines() or [""])[-1][:100]
            print(f"  {res.case.command}: {res.case.what}  -> {last!r}")
    if args.save:
        args.save.write_text(json.dumps(
            [{"argv": x.case.argv, "rc": x.rc, "why": x.failure, "err": x.err[-2000:],
              "out": x.out[-500:]} for x in failed + accepted], indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
