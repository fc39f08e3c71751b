"""Fuzz campaign for the configuration loader (issue 12): N generated files through
gemmd.config.load, counting how each ended.

    .venv/bin/python bench/fuzz_config.py [-n 5000] [--seed 0] [--cli 50] [--save DIR]
    .venv/bin/python bench/fuzz_config.py --run

--run (issue 24) is another campaign: what the check accepts must work. Hostile values by
class (-0.0 where the minimum is 0, repeated and empty choice lists, addresses that look
like IPv4 but are not, bcrypt costs up to 31, TLS sections empty or null, FIFOs and
directories as web config, certificate and key files, model.reference files that are
empty, garbage, truncated, a zip bomb or 3 GiB of nothing) go through `gemmd check-config`
and, where it says OK, `gemmd run` on the fake backend for a few seconds: it must serve
/-/healthy, log the scheme it serves, use its reference model, leave no traceback and stop
on SIGTERM.

Every case must end in a Config or a ConfigError within --timeout seconds; anything else
is a traceback (counted by exception type) or a hang. --cli K also runs K of the cases
through `gemmd check-config` and checks for exit status 0 or 2, one line per problem and no
traceback. --save DIR keeps the files of failing cases (add them to tests/corpus/config/
with an `# expect:` line once fixed). Exit status 1 if any case failed.
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import resource
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gemmd import config, files  # noqa: E402
from gemmd.errors import ConfigError  # noqa: E402

SHIPPED = (ROOT / "gemmd.yaml").read_text()
SECTIONS = yaml.safe_load(SHIPPED)
KEYS = sorted({k for v in SECTIONS.values() if isinstance(v, dict) for k in v} | set(SECTIONS)
              | {"shapes", "dtypes", "kernels", "tiles", "layouts", "backends", "per_round",
                 "every_rounds",
                 "m", "n", "k", "align", "unaligned", "window_s", "warmup_s", "timeout_s", "model"})
WORDS = ["fp32", "bf16", "fp8", "blas", "tiled", "nn", "cpu", "fake", "auto", "nvidia", "all",
         "info", "H100-SXM", "0.0.0.0", "::", "[::1]", "", "a\0b", "127.0.0.1\0", "~"]
INTS = [0, 1, -1, 2**31, 2**63, 10**400, -(10**400), 10**4000]
TOKENS = ["[", "]", "{", "}", ": ", "- ", ", ", "\n", "\n  ", " ", "\t", "&a ", "*a", "<<: ",
          "? ", "!!int ", "!!binary ", "!!set ", "!!timestamp ", "!!python/object ", "!x ",
          "'", '"', "\\0", "#", "---\n", "...\n", "%YAML 1.1\n", "|\n", "~", ".nan", "-.inf",
          "1.0e+999", "0x1F", "1:30:00", "2024-13-01", "9" * 5000, "\0", "\ufeff", "\u2028",
          *KEYS, *WORDS]


def scalar(r: random.Random):
    junk = "".join(chr(r.randint(0, 0x2FF)) for _ in range(r.randint(0, 8)))
    return r.choice([None, True, False, r.randint(-10**6, 10**6), r.choice(INTS),
                     r.uniform(-1e3, 1e3), r.choice([float("nan"), float("inf"), 1e308]),
                     r.choice(WORDS), junk])


def value(r: random.Random, depth: int = 0):
    roll = r.random()
    if depth > 4 or roll < 0.5:
        return scalar(r)
    if roll < 0.75:
        return [value(r, depth + 1) for _ in range(r.randint(0, 4))]
    return {r.choice(KEYS) if r.random() < 0.8 else scalar(r): value(r, depth + 1)
            for _ in range(r.randint(0, 5))}


def corrupt(r: random.Random, doc):
    """The shipped configuration with a few values replaced at random places."""
    if isinstance(doc, dict) and doc:
        k = r.choice(list(doc))
        doc[k] = corrupt(r, doc[k]) if r.random() < 0.7 else value(r)
    elif isinstance(doc, list) and doc:
        i = r.randrange(len(doc))
        doc[i] = corrupt(r, doc[i]) if r.random() < 0.7 else value(r)
    else:
        return value(r)
    return doc


def dump(doc) -> str:
    class Dumper(yaml.SafeDumper):
        pass

    Dumper.add_representer(int, lambda d, v: d.represent_scalar(
        "tag:yaml.org,2002:int", str(v) if v.bit_length() < 14000 else "9" * 5000))
    return yaml.dump(doc, Dumper=Dumper, allow_unicode=True)


def mangle(r: random.Random) -> str:
    lines = SHIPPED.splitlines()
    for _ in range(r.randint(1, 8)):
        i = r.randrange(len(lines))
        op = r.randrange(4)
        if op == 0:
            del lines[i]
        elif op == 1:
            lines.insert(r.randrange(len(lines) + 1), lines[i])  # also: duplicate keys
        elif op == 2:
            j = r.randint(0, len(lines[i]))
            lines[i] = lines[i][:j] + "".join(r.choices(TOKENS, k=r.randint(1, 4))) + lines[i][j:]
        elif ":" in lines[i]:
            lines[i] = lines[i].split(":")[0] + ": " + r.choice(TOKENS)
        if not lines:
            break
    return "\n".join(lines) + "\n"


def deep(r: random.Random) -> str:
    d = r.choice([10, 100, 1000, 10_000, 100_000])
    o, c = r.choice([("[", "]"), ("{a: ", "}"), ("- ", ""), ("{", "}")])
    return "probes: " + ("\n" if o == "- " else "") + o * d + "1" + c * r.randint(0, d)


def bomb(r: random.Random) -> str:
    width, levels = r.randint(2, 12), r.randint(1, 12)
    lines = ["a0: &a0 [" + ", ".join(["x"] * width) + "]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * width) + "]"
              for i in range(1, levels)]
    where = r.choice(["listen: {port: %s}", "probes: {sentinels: [{dtypes: %s}]}",
                      "devices: %s", "zzz: %s"])
    return "\n".join(lines) + "\n" + where % f"*a{levels - 1}\n"


def case(r: random.Random) -> tuple[str, bytes]:
    kind = r.choice(["document", "corrupted", "tokens", "mangled", "deep", "bomb", "bytes"])
    if kind == "document":
        text = dump(value(r))
    elif kind == "corrupted":
        text = dump(corrupt(r, yaml.safe_load(SHIPPED)))
    elif kind == "tokens":
        text = "".join(r.choices(TOKENS, k=r.randint(0, 60)))
    elif kind == "mangled":
        text = mangle(r)
    elif kind == "deep":
        text = deep(r)
    elif kind == "bomb":
        text = bomb(r)
    else:
        return kind, r.randbytes(r.randint(0, 2000))
    return kind, text.encode("utf-8", "surrogatepass")


class Hang(Exception):
    pass


def _alarm(signum, frame):
    raise Hang()


# ----------------------------- accepted by the check, then used (issue 24): --run

def _zip_bomb(path: Path) -> None:
    import zipfile

    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z, z.open("schema.json", "w") as w:
        for _ in range(100):
            w.write(bytes(1 << 20))


def _files(d: Path) -> dict[str, str]:
    """Hostile files a configuration may name, by kind."""
    import bcrypt

    salt = bcrypt.hashpw(b"pw", bcrypt.gensalt(4)).decode()[7:]
    out = {}
    for name, text in {"web-cost31": f"basic_auth_users:\n  p: $2b$31${salt}\n",
                       "web-cost15": f"basic_auth_users:\n  p: $2b$15${salt}\n",
                       "web-cost12": f"basic_auth_users:\n  p: $2b$12${salt}\n",
                       "web-tls-empty": "tls_server_config: {}\n",
                       "web-tls-null": "tls_server_config:\n",
                       "web-auth-only": f"basic_auth_users:\n  p: $2b$04${salt}\n",
                       "web-fifo-cert": "tls_server_config:\n  cert_file: fifo\n"
                                        "  key_file: fifo\n",
                       "web-dir-key": "tls_server_config:\n  cert_file: .\n  key_file: .\n"
                       }.items():
        (d / name).write_text(text)
        out[name] = str(d / name)
    fifo = d / "fifo"
    if not fifo.exists():
        os.mkfifo(fifo)
    out["fifo"] = str(fifo)
    for name, data in {"ref-empty": b"", "ref-garbage": b"garbage" * 100,
                       "ref-truncated": b"PK\x03\x04\x14\x00" + b"\x00" * 40}.items():
        (d / name).write_bytes(data)
        out[name] = str(d / name)
    _zip_bomb(d / "ref-bomb")
    out["ref-bomb"] = str(d / "ref-bomb")
    with open(d / "ref-sparse", "wb") as f:
        f.truncate(3 << 30)
    out["ref-sparse"] = str(d / "ref-sparse")
    out["dir"] = str(d)
    return out


def run_cases(files: dict[str, str]) -> list[tuple[str, dict]]:
    """(name, overrides) for a fake-backend daemon: hostile values by class."""
    cases: list[tuple[str, dict]] = []
    for path, value in [("fake.noise", -0.0), ("fake.jitter", -0.0), ("fake.noise", 0),
                        ("fake.noise", 1.0), ("drift.accept_after_s", -0.0),
                        ("drift.targets", ["runtime", "runtime"]), ("drift.targets", []),
                        ("drift.targets", ["power"]), ("listen.address", "999.1.1.1"),
                        ("listen.address", "1.2.3"), ("listen.address", "256.0.0.1"),
                        ("listen.address", "127.1"), ("listen.address", "localhost"),
                        ("listen.address", "::1"), ("listen.address", "[::1]")]:
        cases.append((f"{path}={value!r}", {path: value}))
    for key in ("web-cost31", "web-cost15", "web-cost12", "web-tls-empty", "web-tls-null",
                "web-auth-only", "web-fifo-cert", "web-dir-key", "fifo", "dir"):
        cases.append((f"listen.web_config_file={key}", {"listen.web_config_file": files[key]}))
    for key in ("ref-empty", "ref-garbage", "ref-truncated", "ref-bomb", "ref-sparse", "fifo",
                "dir"):
        cases.append((f"model.reference={key}", {"model.reference": files[key]}))
    return cases


def _apply(doc: dict, overrides: dict) -> dict:
    for path, value in overrides.items():
        *parents, last = path.split(".")
        d = doc
        for p in parents:
            d = d.setdefault(p, {})
        d[last] = value
    return doc


def run_campaign(work: Path, timeout: float, seconds: float = 4.0, tree: Path = ROOT) -> int:
    """Each case through `gemmd check-config` and, where it says OK, `gemmd run` for a few
    seconds: a configuration the check accepts must run (serve /-/healthy, no traceback,
    stop on SIGTERM, say the scheme it serves); one the check refuses is one line per
    problem. Returns the number of bad cases."""
    import socket
    import urllib.request

    files = _files(work)
    bad = 0
    counts: collections.Counter = collections.Counter()
    print("| case | check-config | run | verdict |\n|---|---|---|---|")
    for name, over in run_cases(files):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        doc = _apply({"backend": "fake", "state_dir": str(work / "state"),
                      "listen": {"address": "127.0.0.1", "port": port},
                      "probes": {"measure": {"window_s": 0.2, "warmup_s": 0}},
                      "schedule": {"probe_interval_s": 1}, "budget": {"duty_cycle": 1.0},
                      "fake": {"devices": [{"model": "H100-SXM"}]}}, over)
        conf = work / "gemmd.yaml"
        conf.write_text(yaml.safe_dump(doc))
        env = {**os.environ, "PYTHONPATH": str(tree)}
        try:
            p = subprocess.run([sys.executable, "-m", "gemmd", "check-config", str(conf)],
                               capture_output=True, text=True, timeout=timeout, cwd=work,
                               env=env)
            check = "OK" if p.returncode == 0 else f"exit {p.returncode}"
            one_line = all(ln.startswith(("gemmd: config error: ", "gemmd: warning: "))
                           for ln in p.stderr.splitlines())
        except subprocess.TimeoutExpired:
            check, one_line = "HANG", False
        verdict, ran = "", "-"
        if check == "HANG" or "Traceback" in (p.stderr if check != "HANG" else ""):
            verdict = "BAD: check-config hung or failed"
        elif check != "OK":
            verdict = "refused" if one_line and p.returncode == 2 else "BAD: messy refusal"
        else:
            host = doc["listen"]["address"]
            url_host = f"[{host}]" if ":" in host else host
            log = work / "run.log"
            with log.open("wb") as f:
                proc = subprocess.Popen([sys.executable, "-m", "gemmd", "run", "--config",
                                         str(conf)], stdout=f, stderr=subprocess.STDOUT,
                                        cwd=work, env=env, start_new_session=True)
            served, end = None, time.monotonic() + timeout
            while time.monotonic() < end and proc.poll() is None and served is None:
                for scheme in ("http", "https"):
                    try:
                        import ssl
                        ctx = ssl._create_unverified_context()
                        with urllib.request.urlopen(f"{scheme}://{url_host}:{port}/-/healthy",
                                                    timeout=1, context=ctx):
                            served = scheme
                    except OSError:
                        pass
                time.sleep(0.2)
            time.sleep(seconds if served else 0)
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                rc = proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                rc = None
            text = log.read_text(errors="replace")
            said = "https" if "metrics on https://" in text else "http" if \
                "metrics on http://" in text else None
            ran = f"served {served}, exit {rc}"
            if rc is None:
                verdict = "BAD: ignored SIGTERM"
            elif "Traceback" in text:
                verdict = "BAD: traceback at run"
            elif served is None:
                verdict = "BAD: accepted, then did not serve"
            elif said != served:
                verdict = f"BAD: says {said}, serves {served}"
            elif "model.reference unusable" in text:
                verdict = "BAD: accepted, then refused at run"
            else:
                verdict = "runs"
        counts[verdict.split(":")[0]] += 1
        bad += verdict.startswith("BAD")
        print(f"| {name} | {check} | {ran} | {verdict} |")
    print(f"\n{sum(counts.values())} cases: " + ", ".join(f"{k} {v}" for k, v in
                                                        sorted(counts.items())))
    return bad


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=2000, help="cases (default 2000)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=10.0, help="seconds per case")
    ap.add_argument("--cli", type=int, default=0, help="also run K cases through the CLI")
    ap.add_argument("--save", type=Path, help="keep failing cases in this folder")
    ap.add_argument("--pure", action="store_true", help="use the pure-Python YAML parser")
    ap.add_argument("--tree", type=Path, default=ROOT,
                    help="--run: the checkout whose gemmd runs (before/after figures)")
    ap.add_argument("--run", action="store_true",
                    help="only the accepted-then-used campaign (issue 24): hostile values "
                         "and files through check-config, then `gemmd run`")
    args = ap.parse_args()
    if args.run:
        with tempfile.TemporaryDirectory(prefix="gemmd-fuzz-run-") as tmp:
            return 1 if run_campaign(Path(tmp), 60.0, tree=args.tree) else 0
    if args.pure:
        files._Loader = files._PyLoader
    r = random.Random(args.seed)
    outcomes: collections.Counter = collections.Counter()
    by_kind: collections.Counter = collections.Counter()
    slowest = (0.0, "")
    failed = []
    signal.signal(signal.SIGALRM, _alarm)
    with tempfile.TemporaryDirectory(prefix="gemmd-fuzz-") as tmp:
        path = Path(tmp) / "gemmd.yaml"
        t_all = time.monotonic()
        for i in range(args.n):
            kind, data = case(r)
            path.write_bytes(data)
            t0 = time.monotonic()
            signal.setitimer(signal.ITIMER_REAL, args.timeout)
            try:
                config.load(path)
                outcome = "ok"
            except ConfigError:
                outcome = "config error"
            except Hang:
                outcome = "HANG"
            except BaseException as e:  # noqa: BLE001 - counting them is the point
                outcome = f"TRACEBACK {type(e).__name__}"
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
            took = time.monotonic() - t0
            slowest = max(slowest, (took, kind))
            outcomes[outcome] += 1
            by_kind[kind, outcome.split()[0]] += 1
            if outcome.isupper() or outcome.startswith("TRACEBACK"):
                failed.append((i, kind, outcome, data))
        cli = collections.Counter()
        for i in range(args.cli):
            kind, data = case(r)
            path.write_bytes(data)
            p = subprocess.run([sys.executable, "-m", "gemmd", "check-config", str(path)],
                               capture_output=True, text=True, timeout=60, cwd=ROOT,
                               env={**os.environ, "PYTHONPATH": str(ROOT)})
            ok = p.returncode in (0, 2) and "Traceback" not in p.stderr and all(
                ln.startswith("gemmd: config error: ") for ln in p.stderr.splitlines())
            cli["ok" if ok else f"BAD exit {p.returncode}"] += 1
            if not ok:
                failed.append((i, f"cli {kind}", p.stderr[-300:], data))
        total = time.monotonic() - t_all
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"{args.n} cases (seed {args.seed}) in {total:.1f} s; slowest {slowest[0]:.2f} s "
          f"({slowest[1]}); peak RSS {rss:.0f} MiB; libyaml: "
          f"{files._Loader is not files._PyLoader}")
    for outcome, n in sorted(outcomes.items()):
        print(f"  {outcome:32} {n:6}")
    print("  by kind: " + ", ".join(f"{k}/{o}={n}" for (k, o), n in sorted(by_kind.items())))
    if args.cli:
        print(f"CLI, {args.cli} cases: " + ", ".join(f"{k}={n}" for k, n in cli.items()))
    for i, kind, outcome, data in failed[:20]:
        print(f"FAILED case {i} ({kind}): {outcome}")
        if args.save:
            args.save.mkdir(parents=True, exist_ok=True)
            (args.save / f"case-{args.seed}-{i}.yaml").write_bytes(data)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
