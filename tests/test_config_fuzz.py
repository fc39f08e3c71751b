"""Property-based fuzzing of the configuration loader (issue 12, "Configuration").

Whatever a configuration holds (random nesting and types, huge integers, NULs, keys from the
real schema, alias bombs, deep nesting, mangled copies of gemmd.yaml), loading it either
succeeds or raises ConfigError with one short line per problem: never another exception,
never a hang. bench/fuzz_config.py runs a longer campaign of the same kind.
"""

from __future__ import annotations

import dataclasses
import math
import time
import typing
from pathlib import Path
from unittest import mock

import pytest
import yaml
from conftest import HANG_S
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gemmd import files
from gemmd.config import Config, checks, load, parse
from gemmd.errors import ConfigError

SHIPPED = (Path(__file__).resolve().parent.parent / "gemmd.yaml").read_text()

FUZZ = settings(max_examples=300, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.filter_too_much])


def _classes(cls: type, out: set[type]) -> set[type]:
    out.add(cls)
    for hint in typing.get_type_hints(cls).values():
        for tp in (hint, *typing.get_args(hint)):
            if dataclasses.is_dataclass(tp) and tp not in out:
                _classes(tp, out)
    return out


CLASSES = _classes(Config, set())
SCHEMA_KEYS = sorted({f.name for c in CLASSES for f in dataclasses.fields(c)})
CHOICES = sorted({c for cls in CLASSES for f in dataclasses.fields(cls)
                  for c in f.metadata.get("choices", ())} | {"all"})
NASTY_INTS = [0, 1, -1, 2**31, 2**63, 2**64 + 1, 10**308, 10**309, 10**400, -(10**400),
              10**4300, 10**5000]


def _nasty_int(i: int) -> int:
    return NASTY_INTS[i]


# Drawn by index: hypothesis repr()s sampled elements, and repr() refuses 4,300+ digits.
nasty_ints = st.integers(0, len(NASTY_INTS) - 1).map(_nasty_int)
NASTY_STRINGS = ["a\0b", "127.0.0.1\0", "", " ", "[::1]", "\n", "é" * 70, "a" * 64, "~",
                 "auto", "GPU-5f1c", "0.0.0.0", "::"]

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), nasty_ints,
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
    st.sampled_from(CHOICES + NASTY_STRINGS))
keys = st.one_of(st.sampled_from(SCHEMA_KEYS), st.text(max_size=8), st.integers(), st.none())
anything = st.recursive(
    scalars, lambda kids: st.one_of(st.lists(kids, max_size=4),
                                    st.dictionaries(keys, kids, max_size=5)), max_leaves=25)


def _schema(tp: typing.Any, meta: dict) -> st.SearchStrategy:
    """Values shaped like the schema (mostly valid), so validation goes deep."""
    if dataclasses.is_dataclass(tp):
        hints = typing.get_type_hints(tp)
        return st.fixed_dictionaries({}, optional={
            f.name: st.one_of(_schema(hints[f.name], dict(f.metadata)), anything)
            for f in dataclasses.fields(tp)})
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        return st.lists(_schema(args[0], meta), max_size=4)
    if origin is tuple:
        return st.tuples(*(_schema(a, meta) for a in args)).map(list)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return st.one_of(*(_schema(a, meta) for a in args))
    lo, hi = meta.get("min"), meta.get("max")
    if tp is bool:
        return st.booleans()
    if tp is int:
        return st.one_of(st.integers(lo, hi), nasty_ints)
    if tp is float:
        ints = st.integers(math.ceil(lo), math.floor(hi)) if math.ceil(lo) <= hi else st.nothing()
        return st.one_of(st.floats(lo, hi), st.floats(), ints)
    if tp is str:
        if meta.get("choices"):
            return st.sampled_from(meta["choices"])
        return st.one_of(st.sampled_from(NASTY_STRINGS), st.text(max_size=12))
    raise TypeError(tp)


documents = st.one_of(_schema(Config, {}), anything)


def _check(outcome: Config | ConfigError, source: str | None = None) -> None:
    if isinstance(outcome, Config):
        return
    assert isinstance(outcome, ConfigError)
    if source is not None:
        assert outcome.source == source
    assert 1 <= len(outcome.problems) <= checks.MAX_PROBLEMS + 1
    for p in outcome.problems:
        assert isinstance(p, str) and len(p) < 2000, p


def _parse(data):
    try:
        return parse(data)
    except ConfigError as e:
        return e


@FUZZ
@given(documents)
def test_any_document_validates_or_raises_config_error(data):
    t0 = time.monotonic()
    _check(_parse(data))
    assert time.monotonic() - t0 < HANG_S  # no hang (speed is measured in bench/fuzz_config.py)


# ------------------------------------------------------------------ YAML text

TOKENS = ["[", "]", "{", "}", ": ", ":", "- ", ", ", "\n", "\n  ", "\n    ", " ", "\t", "&a ",
          "*a", "&b ", "*b", "<<: ", "? ", "!!int ", "!!str ", "!!binary ", "!!set ",
          "!!timestamp ", "!!python/object ", "!foo ", "'", '"', "\\0", "#", "---\n", "...\n",
          "%YAML 1.1\n", "|\n", ">\n", "~", "null", "true", ".nan", ".inf", "-.inf",
          "1e999", "1.0e+999", "0x1F", "0o17", "1:30:00", "2024-13-01", "2001-12-14t21:59:43",
          "<nines>", "\0", "\ufeff", "\x85", "\u2028", *SCHEMA_KEYS, *CHOICES]



def _soup(tokens: list[str]) -> str:
    """Joined tokens; "<nines>" is an integer of 120 or 5,000 digits (kept out of TOKENS
    so that hypothesis does not print it in every strategy's repr)."""
    return "".join("9" * (120 if i % 2 else 5000) if tok == "<nines>" else tok
                   for i, tok in enumerate(tokens))


token_soup = st.lists(st.sampled_from(TOKENS), max_size=40).map(_soup)


@st.composite
def mangled_shipped(draw) -> str:
    """gemmd.yaml with lines deleted, duplicated or spliced with tokens."""
    lines = SHIPPED.splitlines()
    for _ in range(draw(st.integers(1, 6))):
        i = draw(st.integers(0, len(lines) - 1))
        op = draw(st.sampled_from(["delete", "duplicate", "splice", "replace-value"]))
        if op == "delete":
            del lines[i]
        elif op == "duplicate":
            lines.insert(draw(st.integers(0, len(lines))), lines[i])
        elif op == "splice":
            j = draw(st.integers(0, len(lines[i])))
            lines[i] = lines[i][:j] + draw(token_soup) + lines[i][j:]
        elif ":" in lines[i]:
            lines[i] = lines[i].split(":")[0] + ": " + draw(st.sampled_from(TOKENS))
        if not lines:
            break
    return "\n".join(lines) + "\n"


@st.composite
def deep(draw) -> str:
    depth = draw(st.integers(1, 3000))
    opener, closer = draw(st.sampled_from([("[", "]"), ("{a: ", "}"), ("- ", ""),
                                           ("{", "}")]))
    close = draw(st.integers(0, depth))
    key = draw(st.sampled_from(SCHEMA_KEYS))
    return f"{key}: " + ("\n" if opener == "- " else "") + opener * depth + "1" + closer * close


@st.composite
def alias_bomb(draw) -> str:
    width, levels = draw(st.integers(2, 12)), draw(st.integers(1, 12))
    lines = ["a0: &a0 [" + ", ".join(["x"] * width) + "]"]
    for i in range(1, levels):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * width) + "]")
    where = draw(st.sampled_from(["listen: {port: %s}", "probes: {sentinels: [{dtypes: %s}]}",
                                  "devices: %s", "zzz: %s", "probes: {sentinels: %s}"]))
    return "\n".join(lines) + "\n" + where % f"*a{levels - 1}" + "\n"


class _Dumper(yaml.SafeDumper):
    """safe_dump, but integers too long for str() are written as 5,000 nines."""


_Dumper.add_representer(int, lambda d, v: d.represent_scalar(
    "tag:yaml.org,2002:int", str(v) if v.bit_length() < 14000 else "9" * 5000))

texts = st.one_of(
    documents.map(lambda d: yaml.dump(d, Dumper=_Dumper, allow_unicode=True)),
    token_soup, st.text(max_size=200), mangled_shipped(), deep(), alias_bomb())

LOADERS = [pytest.param(files._Loader, 300, id="libyaml" if files._Loader is not
                        files._PyLoader else "python"),
           pytest.param(files._PyLoader, 100, id="pure-python")]


@pytest.fixture(scope="module")
def fuzz_file(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fuzz") / "gemmd.yaml"


@pytest.mark.parametrize("loader, examples", LOADERS)
def test_any_yaml_text_loads_or_raises_config_error(fuzz_file, loader, examples):
    @settings(FUZZ, max_examples=examples)
    @given(text=texts, binary=st.booleans())
    def run(text: str, binary: bool) -> None:
        data = text.encode("utf-8", "surrogatepass")
        if binary:  # bytes a text editor would not write: invalid UTF-8, stray NULs
            data = data.replace(b"a", b"\xff").replace(b"e", b"\x00")
        fuzz_file.write_bytes(data)
        t0 = time.monotonic()
        try:
            outcome = load(fuzz_file)
        except ConfigError as e:
            outcome = e
        assert time.monotonic() - t0 < HANG_S  # no hang (the caps on values and depth)
        _check(outcome, str(fuzz_file))

    # The parse-time cap stays out of it (no time passes on files.clock): whether it fired
    # would depend on the machine's speed; test_config.py tests it with a clock of its own.
    with mock.patch.object(files, "_Loader", loader), \
            mock.patch.object(files, "clock", lambda: 0.0):
        run()


# ----------------------------------------- issue 24: passed check-config, failed at run

@pytest.mark.parametrize("data, problem", [
    ({"drift": {"targets": ["runtime", "runtime"]}}, "drift.targets[1]: 'runtime' is listed "
                                                     "twice"),
    ({"drift": {"targets": []}}, "drift.targets: must not be empty"),
    ({"probes": {"sentinels": [{"shapes": [[64, 64, 64]], "dtypes": ["fp32", "fp16", "fp32"]}]}},
     "probes.sentinels[0].dtypes[2]: 'fp32' is listed twice"),
    ({"listen": {"address": "999.1.1.1"}}, "listen.address: '999.1.1.1' is not an IPv4 "
                                           "address"),
    ({"listen": {"address": "1.2.3"}}, "listen.address: '1.2.3' is not an IPv4 address"),
])
def test_values_that_only_failed_at_run_are_refused_by_the_check(data, problem):
    with pytest.raises(ConfigError) as e:
        parse(data)
    assert any(problem in p for p in e.value.problems), e.value.problems


def test_negative_zero_is_zero():
    """`fake: {noise: -0.0}` passed min 0 and every round tracebacked (numpy: scale < 0):
    every number of the configuration reads -0.0 as 0.0."""
    import numpy as np

    cfg = parse({"fake": {"noise": -0.0, "jitter": -0.0}, "budget": {"duty_cycle": 0.5},
                 "drift": {"accept_after_s": -0.0}})
    for v in (cfg.fake.noise, cfg.fake.jitter, cfg.drift.accept_after_s):
        assert v == 0.0 and math.copysign(1.0, v) == 1.0
    np.random.default_rng(0).normal(0.0, cfg.fake.noise)  # what the fake device does


def test_a_fifo_as_configuration_is_refused_at_once(tmp_path):
    import os

    fifo = tmp_path / "gemmd.yaml"
    os.mkfifo(fifo)
    t = time.monotonic()
    with pytest.raises(ConfigError) as e:
        load(fifo)
    assert "named pipe" in str(e.value) and time.monotonic() - t < 5
