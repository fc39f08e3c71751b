"""A bounded run of bench/fuzz_cli.py in CI (issue 12): hostile values for every option of
every command, read from gemmd's own parser, through the real `gemmd` as a subprocess.
The full set (1,500 cases) is `python bench/fuzz_cli.py --all`; the cases it found are
kept as named tests in test_cli_model.py."""

from __future__ import annotations

import concurrent.futures
import importlib.util
import random
import sys

import pytest
from conftest import ROOT

_spec = importlib.util.spec_from_file_location("fuzz_cli", ROOT / "bench" / "fuzz_cli.py")
assert _spec and _spec.loader
fuzz = importlib.util.module_from_spec(_spec)
sys.modules["fuzz_cli"] = fuzz  # its dataclasses look their module up while defined
_spec.loader.exec_module(fuzz)

CASES = 120  # about 40 s on 2 cores; a different sample each day (seeded by the date)


def test_every_command_and_option_is_fuzzed():
    """The generator reads the parser: a new option is fuzzed without editing the bench."""
    from gemmd.cli import build_parser

    opts = fuzz.options()
    assert {o.command for o in opts} == set(fuzz.BASE)
    predict = {o.flag or o.dest for o in opts if o.command == "predict"}
    assert {"m", "--alpha", "--stages", "--model", "--gpu-spec", "--state-dir"} <= predict
    assert len(fuzz.systematic()) > 1000
    assert build_parser()  # the same parser gemmd runs


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return fuzz.Env(tmp_path_factory.mktemp("fuzz-cli"))


def test_a_sample_of_hostile_command_lines_gets_no_traceback_hang_or_stray_file(env):
    import datetime

    seed = int(datetime.date.today().strftime("%Y%m%d"))
    r = random.Random(seed)
    cases = fuzz.systematic()
    r.shuffle(cases)
    cases = cases[:CASES - CASES // 4] + fuzz.mixed(r, CASES // 4)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda c: fuzz.run_case(env, c, 120.0), cases))
    failed = [f"{r.failure}: gemmd {fuzz._short(r.case.argv)} -> {r.err.strip()[-300:]!r}"
              for r in results if r.failure]
    assert not failed, f"seed {seed}:\n" + "\n".join(failed)
    assert {r.rc for r in results} <= {0, 1, 2}
