"""Fuzz campaign for the configuration loader (issue 12): N generated files through
gemmd.config.load, counting how each ended.

    .venv/bin/python bench/fuzz_config.py [-n 5000] [--seed 0] [--cli 50] [--save DIR]

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

from gemmd import config  # noqa: E402
from gemmd.errors import ConfigError  # noqa: E402

SHIPPED = (ROOT / "gemmd.yaml").read_text()
SECTIONS = yaml.safe_load(SHIPPED)
KEYS = sorted({k for v in SECTIONS.values() if isinstance(v, dict) for k in v} | set(SECTIONS)
              | {"shapes", "dtypes", "kernels", "tiles", "layouts", "backends", "per_round",
                 "m", "n", "k", "align", "window_s", "warmup_s", "timeout_s", "model"})
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=2000, help="cases (default 2000)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=10.0, help="seconds per case")
    ap.add_argument("--cli", type=int, default=0, help="also run K cases through the CLI")
    ap.add_argument("--save", type=Path, help="keep failing cases in this folder")
    ap.add_argument("--pure", action="store_true", help="use the pure-Python YAML parser")
    args = ap.parse_args()
    if args.pure:
        config._Loader = config._PyLoader
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
          f"{config._Loader is not config._PyLoader}")
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
