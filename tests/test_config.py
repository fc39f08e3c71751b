"""Configuration loading and validation (gemmd/config/) and `gemmd check-config`."""

import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from gemmd import config, files
from gemmd.config import Config, MeasureConfig, checks, load, parse
from gemmd.errors import ConfigError

# Not a speed target (speed is measured in bench/): a bound far above normal, far below
# the hangs these cases caused (minutes, or never).
HANG_S = 60
REPO = Path(__file__).resolve().parent.parent
SHIPPED = REPO / "gemmd.yaml"


def problems_of(data):
    with pytest.raises(ConfigError) as ei:
        parse(data)
    return ei.value.problems


def problems_of_file(tmp_path, text, name="gemmd.yaml", mode="w"):
    p = tmp_path / name
    if mode == "wb":
        p.write_bytes(text)
    else:
        p.write_text(text)
    with pytest.raises(ConfigError) as ei:
        load(p)
    assert ei.value.source == str(p)
    return ei.value.problems


def run_cli(*args, cwd=None):
    env = {k: v for k, v in os.environ.items() if k != "GEMMD_CONFIG"}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-m", "gemmd", *args], capture_output=True,
                          text=True, timeout=60, env=env, cwd=cwd or REPO)


# ------------------------------------------------------------------ defaults


def test_shipped_yaml_equals_builtin_defaults():
    # Keeps gemmd.yaml and the dataclass defaults in sync: a change to one must touch both.
    assert load(SHIPPED) == Config()


def test_empty_document_and_none_path_give_defaults(tmp_path):
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing but a comment\n")
    assert load(empty) == Config()
    assert load(None) == Config()


def test_partial_file_overrides_only_given_keys(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("listen: {port: 9000}\nprobes: {measure: {window_s: 2}}\n")
    cfg = load(p)
    assert cfg.listen.port == 9000
    assert cfg.listen.address == Config().listen.address
    assert cfg.probes.measure.window_s == 2.0 and isinstance(cfg.probes.measure.window_s, float)
    assert cfg.probes.sentinels == Config().probes.sentinels


# ------------------------------------------------------------------ invalid values

# (document, expected key path, fragment of the message)
INVALID = [
    pytest.param({"foo": 1}, "foo", "unknown key", id="unknown-top-key"),
    pytest.param({"schedule": {"probe_intervl_s": 3}}, "schedule.probe_intervl_s",
                 "unknown key", id="unknown-nested-key"),
    pytest.param({"listen": {"port": "9477"}}, "listen.port", "expected an integer, got string",
                 id="string-for-int"),
    pytest.param({"listen": {"port": True}}, "listen.port", "expected an integer, got boolean",
                 id="bool-for-int"),
    pytest.param({"probes": {"measure": {"window_s": True}}}, "probes.measure.window_s",
                 "expected a number, got boolean", id="bool-for-float"),
    pytest.param({"schedule": {"skip_when_busy": 1}}, "schedule.skip_when_busy",
                 "expected true or false", id="int-for-bool"),
    pytest.param({"listen": {"port": 70000}}, "listen.port", "above the maximum 65535",
                 id="port-out-of-range"),
    pytest.param({"budget": {"duty_cycle": 0}}, "budget.duty_cycle", "below the minimum",
                 id="duty-cycle-zero"),
    pytest.param({"store": {"retention_days": -1}}, "store.retention_days",
                 "below the minimum", id="negative-retention"),
    pytest.param({"probes": {"measure": {"window_s": -0.5}}}, "probes.measure.window_s",
                 "below the minimum", id="negative-window"),
    pytest.param({"probes": {"exploration": [{"every_rounds": 0}]}},
                 "probes.exploration[0].every_rounds", "below the minimum",
                 id="explore-every-zero-rounds"),
    pytest.param({"backend": "gpu"}, "backend", "'gpu' is not one of auto, nvidia, cpu, fake",
                 id="bad-backend"),
    pytest.param({"probes": {"sentinels": [{}, {"dtypes": ["fp31"]}]}},
                 "probes.sentinels[1].dtypes[0]", "'fp31' is not one of", id="bad-dtype-nested"),
    pytest.param({"probes": {"sentinels": [{"shapes": [[1024, 1024]]}]}},
                 "probes.sentinels[0].shapes[0]", "expected a list of 3 items, got 2",
                 id="shape-arity"),
    pytest.param({"probes": {"sentinels": [{"dtypes": {"fp32": 1}}]}},
                 "probes.sentinels[0].dtypes", "expected a list, got mapping",
                 id="mapping-for-list"),
    pytest.param({"probes": {"sentinels": {"shapes": [[1, 1, 1]]}}}, "probes.sentinels",
                 "expected a list, got mapping", id="mapping-for-list-of-groups"),
    pytest.param({"probes": {"sentinels": [{"shapes": []}]}}, "probes.sentinels[0].shapes",
                 "must not be empty", id="empty-shapes"),
    pytest.param({"probes": {"exploration": [{"dtypes": []}]}},
                 "probes.exploration[0].dtypes", "must not be empty", id="empty-dtypes"),
    pytest.param({"probes": {"sentinels": [{"tiles": [0]}]}}, "probes.sentinels[0].tiles[0]",
                 "below the minimum 1", id="tile-zero"),
    pytest.param({"probes": {"exploration": [{"unaligned": 1.5}]}},
                 "probes.exploration[0].unaligned", "above the maximum",
                 id="exploration-unaligned-share"),
    pytest.param({"probes": {"exploration": [{"m": [512, 256]}]}}, "probes.exploration[0].m",
                 "min > max", id="exploration-range-reversed"),
    pytest.param({"probes": {"measure": {"min_iters": 10, "max_iters": 5}}},
                 "probes.measure.min_iters", "greater than max_iters 5", id="min-gt-max-iters"),
    pytest.param({"budget": {"duty_cycle": 0.001}}, "budget.duty_cycle", "less than one probe",
                 id="duty-cycle-budget-below-one-probe"),
    pytest.param({"devices": "some"}, "devices", "not 'all' or a list", id="devices-some"),
    pytest.param({"devices": 5}, "devices", "expected a string or a list", id="devices-int"),
    pytest.param({"backend": "fake", "fake": {"devices": []}}, "fake.devices",
                 "at least one device", id="fake-without-devices"),
    pytest.param({"fake": {"devices": [{"slowdown_when_file": "x" * 300}]}},
                 "fake.devices[0].slowdown_when_file", "is longer than the 255 allowed",
                 id="fake-slowdown-file-name-too-long"),
    pytest.param([1, 2], "<top>", "expected a mapping, got list", id="top-level-list"),
    # settings that silently turned a part off (a helper's audit): the start-up step
    # check needs 5 baseline rounds, the interval scale 3 trees, a shift must add up
    pytest.param({"drift": {"baseline_probes": 4}}, "drift.baseline_probes",
                 "below the minimum 5", id="baseline-too-short-for-its-check"),
    pytest.param({"model": {"n_estimators": 2}}, "model.n_estimators",
                 "below the minimum 3", id="too-few-trees-for-an-interval"),
    pytest.param({"drift": {"shift": 0.05, "tolerance": 0.05}}, "drift.tolerance",
                 "not below shift 0.05", id="tolerance-not-below-shift"),
]


@pytest.mark.parametrize("data, path, gist", INVALID)
def test_invalid_config_reports_path_and_gist(data, path, gist):
    problems = problems_of(data)
    assert len(problems) == 1, problems
    assert problems[0].startswith(f"{path}: "), problems
    assert gist in problems[0]


def test_duty_cycle_budget_cross_check_uses_interval():
    # 0.001 x 120 s is too little for one probe, but 0.001 x 2000 s = 2 s is enough.
    assert parse({"budget": {"duty_cycle": 0.001}, "schedule": {"probe_interval_s": 2000}})
    assert problems_of({"budget": {"duty_cycle": 0.004},
                        "schedule": {"probe_interval_s": 100}})[0].startswith("budget.duty_cycle")


def test_valid_device_list_is_accepted():
    cfg = parse({"devices": [0, "GPU-5f1c"]})
    assert cfg.devices == (0, "GPU-5f1c")


def test_several_problems_are_all_reported_together():
    problems = problems_of({
        "zzz": 1,
        "listen": {"port": -1},
        "backend": "gpu",
        "probes": {"sentinels": [{"dtypes": ["fp31"], "tiles": [0]}],
                   "measure": {"min_iters": "3"}},
    })
    assert len(problems) == 6, problems
    paths = sorted(p.split(": ")[0] for p in problems)
    assert paths == sorted(["zzz", "listen.port", "backend", "probes.sentinels[0].dtypes[0]",
                            "probes.sentinels[0].tiles[0]", "probes.measure.min_iters"])


def test_nan_is_rejected_for_floats(tmp_path):
    problems = problems_of_file(tmp_path, "budget:\n  duty_cycle: .nan\n")
    assert len(problems) == 1 and problems[0].startswith("budget.duty_cycle: ")


# ------------------------------------------------------------------ file-level errors


def test_invalid_yaml_names_line_and_column(tmp_path):
    problems = problems_of_file(tmp_path, "listen:\n  port: 1\nprobes: [1, 2\nbackend: cpu\n")
    assert len(problems) == 1
    assert "invalid YAML" in problems[0]
    assert problems[0].startswith("line 4, column ")


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError) as ei:
        load(tmp_path / "nope.yaml")
    assert ei.value.problems == ["cannot read: No such file or directory"]


def test_unreadable_path_directory(tmp_path):
    # A directory is unreadable as a file even for root (chmod is not).
    (tmp_path / "dir.yaml").mkdir()
    with pytest.raises(ConfigError) as ei:
        load(tmp_path / "dir.yaml")
    assert ei.value.problems[0].startswith("cannot read: ")


def test_non_utf8_file(tmp_path):
    problems = problems_of_file(tmp_path, b"listen:\n  address: \xff\xfe\n", mode="wb")
    assert len(problems) == 1 and problems[0].startswith("not UTF-8 text")


def test_shipped_yaml_is_valid_yaml_mapping():
    # A guard for the sync test: the shipped file is a real mapping, not an empty document.
    data = yaml.safe_load(SHIPPED.read_text())
    assert isinstance(data, dict) and set(data) >= {"listen", "probes", "schedule", "fake"}


# ------------------------------------------------------------------ CLI


def test_cli_check_config_reports_every_problem(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("listen:\n  port: 70000\nzzz: 1\nbackend: gpu\n")
    r = run_cli("check-config", str(bad))
    assert r.returncode == 2
    lines = r.stderr.splitlines()
    assert len(lines) == 3, r.stderr
    assert all(line.startswith(f"gemmd: config error: {bad}: ") for line in lines)
    assert any("listen.port" in line for line in lines)
    assert "Traceback" not in r.stderr + r.stdout


@pytest.mark.parametrize("content", [b"a: [1, 2\nb: 3\n", b"\xff\xfe", b"- 1\n- 2\n"])
def test_cli_check_config_file_errors_are_one_line(tmp_path, content):
    bad = tmp_path / "bad.yaml"
    bad.write_bytes(content)
    r = run_cli("check-config", str(bad))
    assert r.returncode == 2
    assert len(r.stderr.splitlines()) == 1 and r.stderr.startswith("gemmd: config error:")
    assert "Traceback" not in r.stderr + r.stdout


def test_cli_problem_with_newline_in_key_stays_one_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text('"a\\nb": 1\n')
    r = run_cli("check-config", str(bad))
    assert r.returncode == 2
    assert len(r.stderr.splitlines()) == 1, r.stderr


def test_cli_check_config_shipped_file_ok(tmp_path):
    r = run_cli("check-config", str(SHIPPED), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"{SHIPPED}: OK"


@pytest.mark.parametrize("args, gist", [
    (["probe", "--shape", "12x12"], "not MxNxK"),
    (["probe", "--shape", "0x8x8"], "1..1048576"),
    (["probe", "--tile", "99"], "outside 1..32"),
    (["probe", "--dtype", "fp31"], "invalid choice"),
])
def test_cli_bad_argument_is_one_line_exit_2(args, gist):
    r = run_cli(*args)
    assert r.returncode == 2
    assert r.stderr.startswith("gemmd: error: ")
    assert len(r.stderr.splitlines()) == 1, r.stderr
    assert gist in r.stderr
    assert "Traceback" not in r.stderr + r.stdout


# ------------------------------------------------------------------ state_dir


def test_state_dir_explicit(monkeypatch, tmp_path):
    monkeypatch.setenv("STATE_DIRECTORY", "/should/not/be/used")
    assert Config(state_dir=str(tmp_path / "s")).resolved_state_dir() == tmp_path / "s"
    monkeypatch.setenv("HOME", str(tmp_path))
    assert Config(state_dir="~/g").resolved_state_dir() == tmp_path / "g"


def test_state_dir_auto_systemd(monkeypatch):
    monkeypatch.setenv("STATE_DIRECTORY", "/var/lib/gemmd:/var/lib/other")
    monkeypatch.setenv("XDG_STATE_HOME", "/xdg")
    assert Config().resolved_state_dir() == Path("/var/lib/gemmd")


def test_state_dir_auto_xdg(monkeypatch):
    monkeypatch.delenv("STATE_DIRECTORY", raising=False)
    monkeypatch.setenv("XDG_STATE_HOME", "/xdg/state")
    assert Config().resolved_state_dir() == Path("/xdg/state/gemmd")


def test_state_dir_auto_home_fallback(monkeypatch, tmp_path):
    monkeypatch.delenv("STATE_DIRECTORY", raising=False)
    monkeypatch.delenv("XDG_STATE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert Config().resolved_state_dir() == tmp_path / ".local" / "state" / "gemmd"


# ------------------------------------------------------------------ hostile input (issue 12)
# Every case: a ConfigError naming the key path (and line), quickly; never a traceback.

LOADERS = [pytest.param(files._Loader, id="libyaml" if files._Loader is not
                        files._PyLoader else "python"),
           pytest.param(files._PyLoader, id="pure-python")]


@pytest.fixture(params=LOADERS)
def loader(request, monkeypatch):
    """Run a test with libyaml's parser and with the pure-Python one."""
    monkeypatch.setattr(files, "_Loader", request.param)
    return request.param


def only_problem(tmp_path, text, **kw):
    problems = problems_of_file(tmp_path, text, **kw)
    assert len(problems) == 1, problems
    return problems[0]


def test_libyaml_parser_is_used_when_available():
    if getattr(yaml, "__with_libyaml__", False):
        assert issubclass(files._Loader, yaml.CSafeLoader)


@pytest.mark.parametrize("depth", [5000, 100_000])  # 100k overflowed libyaml's composer (C)
@pytest.mark.parametrize("opener, closer, gist_path", [
    ("[", "]", "probes[0][0][0]"), ("{a: ", "}", "probes.a.a.a"), ("- ", "", "probes[0][0]")])
def test_deep_nesting_is_refused(tmp_path, loader, depth, opener, closer, gist_path):
    text = "probes: " + ("\n" if opener == "- " else "") + opener * depth + "1" + closer * depth
    t0 = time.monotonic()
    problem = only_problem(tmp_path, text + "\n")
    assert time.monotonic() - t0 < HANG_S
    assert problem.startswith(gist_path)
    assert f"nested deeper than {files.MAX_DEPTH} levels (line " in problem


class _RefusesNestingItself(files._PyLoader):
    """A parser with a nesting limit of its own, as libyaml 0.2.6 (PyYAML 6.0.4's wheels)
    has: it refuses before gemmd's composer sees any event, with its own message."""

    def get_event(self):
        raise yaml.scanner.ScannerError(
            None, None, "exceeded maximum nesting depth", yaml.error.Mark("<file>", 1007, 1, 8,
                                                                           None, None))


@pytest.mark.parametrize("opener, closer, gist_path", [
    ("[", "]", "probes[0][0][0]"), ("{a: ", "}", "probes.a.a.a"), ("- ", "", "probes[0][0]")])
def test_a_parser_that_refuses_deep_nesting_itself_still_names_the_key_path(
        tmp_path, monkeypatch, opener, closer, gist_path):
    # Whichever PyYAML and libyaml read the file: gemmd's one line with the key path.
    monkeypatch.setattr(files, "_Loader", _RefusesNestingItself)
    text = "x: 1\nprobes: " + ("\n" if opener == "- " else "") + opener * 2000 + "1" + \
        closer * 2000
    problem = only_problem(tmp_path, text + "\n")
    assert problem.startswith(gist_path)
    assert f"nested deeper than {files.MAX_DEPTH} levels (line " in problem


def test_nesting_refused_by_the_parser_alone_is_still_gemmds_message(tmp_path, monkeypatch):
    monkeypatch.setattr(files, "_Loader", _RefusesNestingItself)
    assert only_problem(tmp_path, "probes: [[1]]\n") == \
        f"<top>: nested deeper than {files.MAX_DEPTH} levels (line 2)"


@pytest.mark.parametrize("where", ["top", "value", "list"])
def test_alias_bomb_is_refused_quickly(tmp_path, loader, where):
    lines = ['a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for i in range(1, 10):
        cur, prev = "abcdefghij"[i], "abcdefghij"[i - 1]
        lines.append(f"{cur}: &{cur} [" + ",".join([f"*{prev}"] * 9) + "]")
    text = "\n".join(lines) + "\n"  # 9^10 strings once expanded
    if where == "value":  # was: 15 s and 1.2 GB formatting the error message
        text = "\n".join(lines) + "\nlisten: {port: *j}\n"
    elif where == "list":
        text = "\n".join(lines) + "\nprobes: {sentinels: [{dtypes: *j}]}\n"
    t0 = time.monotonic()
    problem = only_problem(tmp_path, text)
    assert time.monotonic() - t0 < HANG_S
    assert f"aliases expand the document beyond {files.MAX_VALUES:,} values" in problem
    assert "(line " in problem


def test_recursive_alias_and_merge_chain_are_refused(tmp_path, loader):
    assert "recursive structure" in only_problem(tmp_path, "a: &a [1, *a]\n")
    chain = "x0: &x0 {q: 1}\n" + "".join(f"x{i}: &x{i} {{<<: *x{i - 1}}}\n" for i in range(1, 2000))
    assert "merge keys (<<) chained deeper than" in only_problem(tmp_path, chain)


def test_modest_aliases_and_merge_keys_still_work(tmp_path, loader):
    p = tmp_path / "c.yaml"
    p.write_text("probes:\n  sentinels:\n    - &g {shapes: [[64, 64, 64]], dtypes: &d [fp32]}\n"
                 "    - <<: *g\n      kernels: [tiled]\n  exploration:\n    - {dtypes: *d}\n")
    cfg = load(p)
    assert cfg.probes.sentinels[1].shapes == ((64, 64, 64),)
    assert cfg.probes.sentinels[1].kernels == ("tiled",)
    assert cfg.probes.exploration[0].dtypes == ("fp32",)


def test_oversized_file_is_refused_before_parsing(tmp_path):
    problem = only_problem(tmp_path, "#" * files.MAX_FILE_BYTES + "\n")
    assert problem.startswith("larger than 1024 KiB")


def test_dev_zero_is_refused_with_a_bounded_read():
    with pytest.raises(ConfigError) as ei:
        load("/dev/zero")
    assert ei.value.problems == ["larger than 1024 KiB: not a configuration file"]


class TickingClock:
    """files.clock, injected: every reading is ``step`` seconds after the previous one, so
    the parse-time cap fires after a fixed amount of work, however fast the machine is."""

    def __init__(self, step: float):
        self.step, self.now, self.reads = step, 0.0, 0

    def __call__(self) -> float:
        self.reads += 1
        self.now += self.step
        return self.now


@pytest.fixture
def frozen_clock(monkeypatch):
    """No time passes while a test reads YAML: the parse-time cap never fires, whatever
    else runs on the machine (a test about another cap must not race this one)."""
    clock = TickingClock(0.0)
    monkeypatch.setattr(files, "clock", clock)
    return clock


def test_parse_time_is_capped(tmp_path, loader, monkeypatch):
    # The clock is read once for the deadline (5 s later), then once per 1,024 events, each
    # reading a second later: it has passed at the 6th of those, 6 x 1,024 events in.
    clock = TickingClock(1.0)
    monkeypatch.setattr(files, "clock", clock)
    problem = only_problem(tmp_path, "devices: [" + ", ".join(["0"] * 10_000) + "]\n")
    assert problem == "devices[6140]: reading took longer than 5 s (line 1)"
    assert clock.reads == 1 + 6


def test_parse_time_cap_is_not_reached_by_a_normal_file(tmp_path, loader, monkeypatch):
    clock = TickingClock(1.0)
    monkeypatch.setattr(files, "clock", clock)
    assert load(SHIPPED) == Config()
    assert clock.reads == 1  # a few hundred events: the clock is read only for the deadline


def test_large_file_is_refused_by_the_value_cap(tmp_path, loader, frozen_clock):
    # ~1 MB: the value cap ends it, with either parser, before it is read in full. (It took
    # 5.5-10 s with the pure-Python parser before the cap; the time cap is another test's.)
    row = "    - {shapes: [[1024, 1024, 1024]], dtypes: [fp32], kernels: [blas]}\n"
    text = "probes:\n  sentinels:\n" + row * (1_000_000 // len(row))
    problem = only_problem(tmp_path, text)  # refused by the value cap, not read in full
    assert f"more than {files.MAX_VALUES:,} values" in problem
    assert problem.startswith("probes.sentinels[")


def test_a_commented_file_near_the_size_cap_loads(tmp_path, loader, frozen_clock):
    text = SHIPPED.read_text()
    text += "# padding\n" * ((files.MAX_FILE_BYTES - len(text)) // 10)
    p = tmp_path / "c.yaml"
    p.write_text(text)
    assert load(p) == Config()


@pytest.mark.parametrize("text, gist", [
    ("listen:\n  port: 1\nbackend: cpu\nlisten:\n  port: 2\n",
     "listen: duplicate key (lines 1 and 4)"),
    ("listen:\n  port: 1\n  'port': 2\n", "listen.port: duplicate key (lines 2 and 3)"),
    ("probes:\n  sentinels:\n    - dtypes: [fp32]\n      dtypes: [fp64]\n",
     "probes.sentinels[0].dtypes: duplicate key (lines 3 and 4)"),
])
def test_duplicate_keys_are_refused_naming_both_lines(tmp_path, loader, text, gist):
    assert only_problem(tmp_path, text).startswith(gist)


def test_merge_key_may_override_without_being_a_duplicate(tmp_path, loader):
    p = tmp_path / "c.yaml"
    p.write_text("listen:\n  <<: {port: 1, address: 127.0.0.1}\n  port: 2\n")
    assert load(p).listen.port == 2


@pytest.mark.parametrize("digits", [400, 4301, 5000])
@pytest.mark.parametrize("key", ["listen:\n  port", "budget:\n  duty_cycle"])
def test_huge_integer_in_a_file(tmp_path, loader, digits, key):
    problem = only_problem(tmp_path, f"{key}: {'9' * digits}\n")
    assert f"integer of {digits:,} characters" in problem and "(line 2)" in problem
    assert len(problem) < 200


@pytest.mark.parametrize("value", [10**400, -(10**400), 10**5000],
                         ids=["1e400", "-1e400", "1e5000"])
@pytest.mark.parametrize("section, key", [("budget", "duty_cycle"), ("listen", "port")])
def test_huge_integer_in_a_mapping(value, section, key):
    problems = problems_of({section: {key: value}})  # was OverflowError / ValueError
    assert len(problems) == 1 and problems[0].startswith(f"{section}.{key}: ")
    assert "maximum" in problems[0] or "minimum" in problems[0]
    assert len(problems[0]) < 200


def test_infinite_float_is_refused(tmp_path):
    assert "not a finite number" in only_problem(tmp_path, "budget: {duty_cycle: 1.0e+999}\n")


@pytest.mark.parametrize("text, path", [
    ('state_dir: "a\\0b"\n', "state_dir"),
    ('listen:\n  address: "127.0.0.1\\0"\n', "listen.address"),
    ('devices: ["GPU-1\\0"]\n', "devices[0]"),
])
def test_nul_in_a_string_is_refused(tmp_path, text, path):
    problem = only_problem(tmp_path, text)
    assert problem.startswith(f"{path}: ") and "contains a NUL character" in problem


def test_lone_surrogate_is_refused(tmp_path, loader):
    # libyaml refuses "\ud800" as YAML; the pure-Python parser decodes it into a str that
    # no path or host name can hold (UnicodeEncodeError in mkdir).
    problems = problems_of_file(tmp_path, 'state_dir: "\\ud800"\n')
    assert len(problems) == 1
    assert "lone surrogate" in problems[0] or "invalid Unicode" in problems[0]
    assert problems_of({"state_dir": "\ud800"})[0].startswith("state_dir: ")


@pytest.mark.parametrize("command", [["check-config"], ["run", "--config"]])
def test_cli_nul_state_dir_is_a_config_error_not_a_traceback(tmp_path, command):
    bad = tmp_path / "bad.yaml"
    bad.write_text('state_dir: "a\\0b"\nlisten: {address: "127.0.0.1\\0", port: 0}\n')
    r = run_cli(*command, str(bad))
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr + r.stdout
    lines = r.stderr.splitlines()
    assert len(lines) == 2 and all(ln.startswith(f"gemmd: config error: {bad}: ") for ln in lines)
    assert "state_dir: 'a\\x00b' contains a NUL character (line 1)" in r.stderr


@pytest.mark.parametrize("args, gist", [
    (["check-config", "/dev/zero"], "/dev/zero: larger than 1024 KiB"),
    (["check-config", ""], "'': cannot read: the file name is empty"),
    (["run", "--config", ""], "'': cannot read: the file name is empty"),
])
def test_cli_unusable_config_file_is_one_line(args, gist):
    r = run_cli(*args)
    assert r.returncode == 2
    assert len(r.stderr.splitlines()) == 1, r.stderr
    assert r.stderr.startswith(f"gemmd: config error: {gist}"), r.stderr


@pytest.mark.parametrize("text", ["a: 2024-13-01\n", "a: !!binary '?'\n", "a: !foo 1\n",
                                  "a: !!int ''\n", "a: !!timestamp x\n", "a: !!float x\n",
                                  "a: 1\n---\nb: 2\n", "a: [1\n", "? [a]\n: 1\n", "a: \0\n",
                                  "a: &x 1\nb: &x 2\n", "a: *nope\n"])
def test_odd_yaml_is_a_config_error(tmp_path, loader, text):
    problems_of_file(tmp_path, text)


def test_problem_list_is_bounded(tmp_path):
    problems = problems_of_file(tmp_path, "".join(f"k{i}: 1\n" for i in range(500)))
    assert len(problems) == checks.MAX_PROBLEMS + 1
    assert problems[-1] == "<top>: 400 more problems not shown"


def test_validation_problems_name_their_line(tmp_path):
    problems = problems_of_file(tmp_path, "listen:\n  port: 1\nprobes:\n  sentinels:\n"
                                          "    - {dtypes: [fp32, fp31]}\n")
    assert problems == ["probes.sentinels[0].dtypes[1]: 'fp31' is not one of fp64, fp32, "
                        "tf32, fp16, bf16, fp8 (line 5)"]


# ------------------------------------------------------------------ semantic checks


@pytest.mark.parametrize("backend, window, ok", [
    ("auto", 0.1, False), ("nvidia", 0.49, False), ("nvidia", 0.5, True),
    ("fake", 0.1, False), ("fake", 0.2, True), ("cpu", 0.1, True)])
def test_window_must_resolve_the_energy_counter(backend, window, ok):
    data = {"backend": backend, "probes": {"measure": {"window_s": window}}}
    if ok:
        assert parse(data).probes.measure.window_s == window
        return
    problems = problems_of(data)
    assert len(problems) == 1 and problems[0].startswith("probes.measure.window_s: ")
    assert "100 ms steps" in problems[0] and f"backend {backend}" in problems[0]


def test_window_bound_is_for_loaded_configs_only():
    # Tests and tools build short windows in Python on purpose (simulated time).
    assert MeasureConfig(window_s=0.1).window_s == 0.1
    assert parse({}).probes.measure.window_s >= config.MIN_WINDOW_S["auto"]


SEMANTIC = [
    pytest.param({"probes": {"sentinels": [{"shapes": [[1024, 1024, 1024], [1 << 20] * 3],
                                            "dtypes": ["fp32", "bf16"]}]}},
                 "probes.sentinels[0].shapes[1]", "even in bf16, over budget.memory_mb 2048",
                 id="sentinel-over-memory"),
    pytest.param({"probes": {"exploration": [{"m": [1 << 17] * 2, "n": [1 << 17] * 2,
                                              "k": [1 << 17] * 2}]}},
                 "probes.exploration[0]", "no draw could run", id="exploration-over-memory"),
    pytest.param({"probes": {"sentinels": [{"shapes": [[64, 64, i] for i in range(1, 300)],
                                            "dtypes": ["fp32", "fp64"],
                                            "layouts": ["nn", "tt"]}]}},
                 "probes.sentinels", "1,196 probe configurations, more than 1,000",
                 id="too-many-sentinels"),
    pytest.param({"probes": {"measure": {"timeout_s": 2, "window_s": 2}},
                  "budget": {"duty_cycle": 1}},
                 "probes.measure.timeout_s", "every probe would be declared hung",
                 id="timeout-shorter-than-window"),
    pytest.param({"devices": [0, 0]}, "devices[1]", "listed twice", id="devices-duplicate"),
    pytest.param({"devices": [-1]}, "devices[0]", "not a device index", id="devices-negative"),
    pytest.param({"devices": []}, "devices", "selects no device", id="devices-empty"),
    pytest.param({"state_dir": ""}, "state_dir", "must not be empty", id="state-dir-empty"),
    pytest.param({"listen": {"address": ""}}, "listen.address", "not an IP address",
                 id="address-empty"),
    pytest.param({"listen": {"address": "[::1]"}}, "listen.address", "without brackets",
                 id="address-brackets"),
    pytest.param({"listen": {"address": "a" * 64}}, "listen.address", "not an IP address",
                 id="address-label-too-long"),
    # stat() raised on these instead of answering (a traceback)
    pytest.param({"state_dir": "s" * 300}, "state_dir", "a file name of 300 bytes",
                 id="state-dir-name-too-long"),
    pytest.param({"model": {"reference": "r" * 5000}}, "model.reference",
                 "a path of 5,000 bytes", id="reference-path-too-long"),
]


@pytest.mark.parametrize("data, gist", [
    ({"model": {"min_samples": 5000, "max_training_rows": 100}},
     "more than model.max_training_rows 100"),
    ({"model": {"min_samples": 5000}, "store": {"max_rows": 100}}, "more than store.max_rows 100"),
])
def test_a_model_that_can_never_be_fitted_is_a_warning(tmp_path, data, gist):
    """Valid (a test or a reference-only host may want no fit of its own), but said by
    check-config and logged by gemmd run at start (issue 12 audit: it passed silently)."""
    assert any(gist in w for w in config.warnings(parse(data)))
    assert config.warnings(parse({})) == []
    f = tmp_path / "g.yaml"
    f.write_text(yaml.safe_dump(data))
    r = subprocess.run([sys.executable, "-m", "gemmd", "check-config", str(f)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and f"gemmd: warning: model.min_samples 5,000 is {gist}" in r.stderr


def test_a_reference_sha256_that_does_not_match_the_file_is_refused_at_check(tmp_path):
    ref = tmp_path / "fleet.skops"
    ref.write_bytes(b"a model")
    good = hashlib.sha256(b"a model").hexdigest()
    assert parse({"model": {"reference": str(ref), "reference_sha256": good.upper()}})
    problems = problems_of({"model": {"reference": str(ref), "reference_sha256": "0" * 64}})
    assert len(problems) == 1 and problems[0].startswith("model.reference_sha256: does not "
                                                         "match") and good in problems[0]


@pytest.mark.parametrize("data, path, gist", SEMANTIC)
def test_semantically_wrong_config_is_refused(data, path, gist):
    problems = problems_of(data)
    assert len(problems) == 1, problems
    assert problems[0].startswith(f"{path}: ") and gist in problems[0], problems


@pytest.mark.parametrize("address", ["0.0.0.0", "::", "127.0.0.1", "fe80::1%eth0", "localhost",
                                     "gpu-node-07.example.org", "gemmd_exporter"])
def test_valid_listen_addresses(address):
    assert parse({"listen": {"address": address}}).listen.address == address


# ------------------------------------------------------------------ regression corpus

CORPUS = REPO / "tests" / "corpus" / "config"


@pytest.mark.parametrize("path", sorted(CORPUS.glob("*.yaml")), ids=lambda p: p.name)
def test_corpus(path, loader):
    """Each file's first line says what it must give: `# expect: OK` or `# expect: TEXT`
    (a fragment of the one problem reported)."""
    first = path.read_bytes().split(b"\n", 1)[0].decode()
    assert first.startswith("# expect: "), path
    expect = first[len("# expect: "):]
    t0 = time.monotonic()
    if expect == "OK":
        load(path)
    else:
        with pytest.raises(ConfigError) as ei:
            load(path)
        assert ei.value.source == str(path)
        assert any(expect in p for p in ei.value.problems), ei.value.problems
    assert time.monotonic() - t0 < HANG_S


@pytest.mark.parametrize("args, gist", [
    (["probe", "--backend", "fake", "--window", "0.1"],
     "command line (--window=0.1): probes.measure.window_s: 0.1 s is too short"),
    (["probe", "--backend", "fake", "--window", "nan"], "command line (--window=nan)"),
    (["probe", "--backend", "fake", "--window", "1e12"], "command line (--window=1000000000000.0)"),
    (["run", "--backend", "fake", "--port", "65536"],
     "command line (--port=65536): listen.port"),
    (["run", "--backend", "fake", "--port", "-1000000000000"], "command line (--port="),
])
def test_cli_overrides_are_checked_like_the_file(args, gist):
    """Command-line overrides used to skip the config's ranges (and --port 65536 ended in
    a traceback): they are checked by the same rules, one line, exit 2."""
    r = run_cli(*args)
    assert r.returncode == 2, r.stderr
    assert len(r.stderr.splitlines()) == 1, r.stderr
    assert r.stderr.startswith(f"gemmd: config error: {gist}"), r.stderr


def test_check_config_warns_when_the_budget_cannot_run_a_whole_round(tmp_path):
    tight = tmp_path / "tight.yaml"
    tight.write_text("schedule: {probe_interval_s: 2}\nbudget: {duty_cycle: 0.5}\n")
    r = run_cli("check-config", str(tight))
    assert r.returncode == 0 and r.stdout.strip().endswith(": OK")
    assert r.stderr.startswith("gemmd: warning: budget: 0.5 x 2 s = 1 s a round fits "
                               "about 1 of the 3 probes"), r.stderr
    assert "each probe runs about every 3 rounds" in r.stderr
    r = run_cli("check-config", str(REPO / "gemmd.yaml"))
    assert r.returncode == 0 and r.stderr == ""


def test_common_options_work_before_and_after_the_command(tmp_path):
    before = run_cli("--state-dir", str(tmp_path), "status")
    after = run_cli("status", "--state-dir", str(tmp_path))
    assert before.returncode == after.returncode == 1
    assert before.stderr == after.stderr and str(tmp_path / "gemmd.db") in before.stderr
    # After the command wins; a bad --config before it is still read when not overridden.
    r = run_cli("--state-dir", "/nonexistent", "status", "--state-dir", str(tmp_path))
    assert str(tmp_path / "gemmd.db") in r.stderr
    r = run_cli("--config", str(tmp_path / "missing.yaml"), "check-config")
    assert r.returncode == 2 and "missing.yaml" in r.stderr
