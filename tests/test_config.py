"""Configuration loading and validation (gemmd/config.py) and `gemmd check-config`."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from gemmd.config import Config, load, parse
from gemmd.errors import ConfigError

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
    pytest.param([1, 2], "<top>", "expected a mapping, got list", id="top-level-list"),
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
    assert problems_of({"budget": {"duty_cycle": 0.01},
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
