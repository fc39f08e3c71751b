"""Load and validate gemmd.yaml into the schema's frozen dataclasses.

Validation runs once, at start-up: every problem is collected with its key path
(``probes.sentinels[1].dtypes[0]``) and, for a file, its line, and reported together in one
ConfigError: types and ranges field by field (the schema's metadata), then the checks
across sections (a budget that fits no probe, a window too short for the energy counter,
buffers over the memory budget, the model reference and its checksum, the web
configuration file). ``warnings`` says what a valid configuration does that its author
may not expect.
"""

from __future__ import annotations

import dataclasses
import functools
import ipaddress
import math
import re
import types
import typing
from pathlib import Path
from typing import Any

from gemmd.config.schema import (
    Config,
    DriftConfig,
    ExplorationConfig,
    ListenConfig,
    MeasureConfig,
    ProbeGroup,
)
from gemmd.config.web import load_web_config
from gemmd.errors import ConfigError
from gemmd.files import (
    _join,
    _key_text,
    _lines,
    _problem,
    _short,
    _typename,
    file_sha256,
    path_problem,
    read_file,
    read_yaml,
)
from gemmd.gemm import ProbeSpec

MAX_PROBLEMS = 100  # problems reported; the rest are counted
MAX_SENTINELS = 1000  # sentinel probe configurations per round (each is its own series)
# NVML's total-energy counter moves in ~100 ms steps (the fake backend simulates the same).
# A window must span enough steps to resolve a probe's energy: five on real GPUs (step
# method over >= 0.4 s, window delta within +-20%), two on the simulation (the least that
# the step method can use). RAPL (cpu) counts in ~1 ms steps: no extra bound.
ENERGY_STEP_S = 0.1
MIN_WINDOW_S = {"auto": 5 * ENERGY_STEP_S, "nvidia": 5 * ENERGY_STEP_S,
                "fake": 2 * ENERGY_STEP_S}
_HOSTNAME = re.compile(r"(?!-)[\w-]{1,63}(?<!-)(\.(?!-)[\w-]{1,63}(?<!-))*\.?", re.ASCII)

# ---------------------------------------------------------------- validation


class _Errors(list):
    """(key path, message) pairs."""

    def add(self, path: str, msg: str) -> None:
        self.append((path, msg))


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _convert(value: Any, tp: Any, meta: dict, path: str, errs: _Errors) -> Any:
    """Convert a YAML value to ``tp``; record errors and return a placeholder on failure."""
    origin = typing.get_origin(tp)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return _build(tp, value, path, errs)
    if origin in (typing.Union, types.UnionType):
        alts = typing.get_args(tp)
        # Try each alternative silently; report against the first that fits the YAML kind.
        for alt in alts:
            trial = _Errors()
            out = _convert(value, alt, meta, path, trial)
            if not trial:
                return out
            if (isinstance(value, list) and typing.get_origin(alt) is tuple) or \
                    (alt in (str, int) and type(value) is alt):
                errs.extend(trial)  # this alternative was meant: say what is wrong with it
                return None
        errs.add(path, f"expected {' or '.join(_describe(a) for a in alts)}, got "
                       f"{_typename(value)} {_short(value)}")
        return None
    if origin is tuple:
        args = typing.get_args(tp)
        if not isinstance(value, (list, tuple)):
            errs.add(path, f"expected a list, got {_typename(value)} {_short(value)}")
            return None
        if len(args) == 2 and args[1] is Ellipsis:
            if meta.get("choices"):  # a set of choices: each once (issue 24)
                for i, v in enumerate(value):
                    if isinstance(v, str) and v in value[:i]:
                        errs.add(f"{path}[{i}]", f"{_short(v)} is listed twice")
            return tuple(_convert(v, args[0], meta, f"{path}[{i}]", errs)
                         for i, v in enumerate(value))
        if len(value) != len(args):
            errs.add(path, f"expected a list of {len(args)} items, got {len(value)}")
            return None
        out = tuple(_convert(v, a, meta, f"{path}[{i}]", errs)
                    for i, (v, a) in enumerate(zip(value, args)))
        return out
    if tp is bool:
        if not isinstance(value, bool):
            errs.add(path, f"expected true or false, got {_typename(value)} {_short(value)}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            errs.add(path, f"expected an integer, got {_typename(value)} {_short(value)}")
            return value
        _check_range(value, meta, path, errs)
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            errs.add(path, f"expected a number, got {_typename(value)} {_short(value)}")
            return value
        try:
            as_float = float(value) + 0.0  # -0.0 is 0.0: it passes min 0 (issue 24)
        except OverflowError:  # an integer beyond 1e308: compare it exactly, as an int
            as_float = None
        if as_float is not None and not math.isfinite(as_float):
            errs.add(path, f"{value} is not a finite number")
            return value
        before = len(errs)
        _check_range(value if as_float is None else as_float, meta, path, errs)
        if as_float is None and len(errs) == before:
            errs.add(path, f"{_short(value)} is out of range")
        return value if as_float is None else as_float
    if tp is str:
        if not isinstance(value, str):
            errs.add(path, f"expected a string, got {_typename(value)} {_short(value)}")
            return value
        if "\0" in value:
            errs.add(path, f"{_short(value)} contains a NUL character")
            return value
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:  # "\ud800" in YAML: no file or host name can hold it
            errs.add(path, f"{_short(value)} contains a lone surrogate, which is not text")
            return value
        choices = meta.get("choices")
        if choices and value not in choices:
            errs.add(path, f"{_short(value)} is not one of {', '.join(choices)}")
        return value
    raise TypeError(f"unsupported config type {tp!r}")  # programming error


def _describe(tp: Any) -> str:
    if typing.get_origin(tp) is tuple:
        return "a list"
    return {str: "a string", int: "an integer", float: "a number", bool: "a boolean"}.get(
        tp, getattr(tp, "__name__", str(tp)))


def _check_range(v: float, meta: dict, path: str, errs: _Errors) -> None:
    lo, hi = meta.get("min"), meta.get("max")
    if lo is not None and v < lo:
        errs.add(path, f"{_short(v)} is below the minimum {lo}")
    elif hi is not None and v > hi:
        errs.add(path, f"{_short(v)} is above the maximum {hi}")


def _build(cls: type, data: Any, path: str, errs: _Errors) -> Any:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        errs.add(path, f"expected a mapping, got {_typename(data)} {_short(data)}")
        return cls()
    before = len(errs)
    hints = _hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in data:
        if key not in fields:
            known = ", ".join(sorted(fields))
            errs.add(_join(path, _key_text(key)), f"unknown key (known keys: {known})")
    kwargs = {}
    for name, f in fields.items():
        if name in data:
            kwargs[name] = _convert(data[name], hints[name], dict(f.metadata),
                                    _join(path, name), errs)
    if len(errs) > before:
        return None
    obj = cls(**kwargs)
    _cross_checks(obj, path, errs)
    return obj


def _cross_checks(obj: Any, path: str, errs: _Errors) -> None:
    """Checks that involve more than one field of one section."""
    if isinstance(obj, ExplorationConfig):
        for dim in ("m", "n", "k"):
            lo, hi = getattr(obj, dim)
            if lo > hi:
                errs.add(_join(path, dim), f"range [{lo}, {hi}] is empty (min > max)")
    if isinstance(obj, MeasureConfig):
        if obj.min_iters > obj.max_iters:
            errs.add(_join(path, "min_iters"),
                     f"{obj.min_iters} is greater than max_iters {obj.max_iters}")
        if obj.timeout_s <= obj.warmup_s + obj.window_s:
            errs.add(_join(path, "timeout_s"),
                     f"{obj.timeout_s:g} s is not longer than warmup_s + window_s "
                     f"({obj.warmup_s + obj.window_s:g} s): every probe would be declared hung")
    if isinstance(obj, (ProbeGroup, ExplorationConfig)):
        for name in ("dtypes", "kernels", "layouts", "tiles"):
            if not getattr(obj, name):
                errs.add(_join(path, name), "must not be empty")
    if isinstance(obj, ProbeGroup) and not obj.shapes:
        errs.add(_join(path, "shapes"), "must not be empty")
    if isinstance(obj, ListenConfig):
        _check_address(obj.address, _join(path, "address"), errs)
    if isinstance(obj, DriftConfig) and not obj.targets:
        errs.add(_join(path, "targets"), "must not be empty (runtime, power, energy)")
    if isinstance(obj, DriftConfig) and obj.tolerance >= obj.shift:
        errs.add(_join(path, "tolerance"),
                 f"{obj.tolerance:g} is not below shift {obj.shift:g}: a change of shift "
                 "would never add up to an alarm (0 turns the slow-level alarm off)")
    if isinstance(obj, Config):
        _check_config(obj, errs)


def _check_address(addr: str, path: str, errs: _Errors) -> None:
    try:
        ipaddress.ip_address(addr)
        return
    except ValueError:
        pass
    if re.fullmatch(r"[\d.]+", addr):  # no host name is all digits: a bad IPv4 address
        errs.add(path, f"{_short(addr)} is not an IPv4 address (four numbers 0-255: a.b.c.d)")
    elif len(addr) > 253 or not _HOSTNAME.fullmatch(addr):
        hint = " (write IPv6 addresses without brackets)" if addr.startswith("[") else ""
        errs.add(path, f"{_short(addr)} is not an IP address or host name{hint}")


def _check_web_config(path: str, errs: _Errors) -> None:
    """The web configuration file is checked with the configuration."""
    try:
        load_web_config(path)
    except ConfigError as e:
        for problem in e.problems:
            errs.add("listen.web_config_file", f"{path}: {problem}")


def _check_reference(cfg: Config, errs: _Errors) -> None:
    ref, sha = cfg.model.reference, cfg.model.reference_sha256
    found = False
    if ref and path_problem(ref):
        errs.add("model.reference", f"{_short(ref)}: {path_problem(ref)}")
    elif ref and not Path(ref).expanduser().is_file():
        errs.add("model.reference", f"{_short(ref)}: no such file")
    else:
        found = bool(ref)
    if sha and not re.fullmatch(r"[0-9a-fA-F]{64}", sha):
        errs.add("model.reference_sha256", "must be 64 hexadecimal digits (sha256sum)")
    elif sha and not ref:
        errs.add("model.reference_sha256", "set without model.reference")
    elif sha and found:  # checked now, not only when the daemon loads it
        try:
            digest: str | None = file_sha256(Path(ref).expanduser())
        except OSError:
            digest = None  # unreadable: the daemon says why when it loads the file
        if digest is not None and digest != sha.lower():
            errs.add("model.reference_sha256", f"does not match {_short(ref)} (its sha256 is "
                                               f"{digest}): the file changed, or the wrong "
                                               "file is named")


def _check_config(cfg: Config, errs: _Errors) -> None:
    """Checks across sections of the whole configuration."""
    _check_reference(cfg, errs)
    if cfg.listen.web_config_file:
        _check_web_config(cfg.listen.web_config_file, errs)
    if isinstance(cfg.devices, str) and cfg.devices != "all":
        errs.add("devices", f"{_short(cfg.devices)} is not 'all' or a list of indices/UUIDs")
    elif isinstance(cfg.devices, tuple):
        if not cfg.devices:
            errs.add("devices", "an empty list selects no device (use 'all' for every device)")
        seen: set[int | str] = set()
        for i, d in enumerate(cfg.devices):
            if isinstance(d, int) and d < 0:
                errs.add(f"devices[{i}]", f"{d} is not a device index (0 or more)")
            elif isinstance(d, str) and not d.strip():
                errs.add(f"devices[{i}]", "an empty UUID")
            elif d in seen:
                errs.add(f"devices[{i}]", f"{_short(d)} is listed twice")
            seen.add(d)
    if not cfg.state_dir.strip():
        errs.add("state_dir", "must not be empty (a directory, or 'auto')")
    elif path_problem(cfg.state_dir):
        errs.add("state_dir", f"{_short(cfg.state_dir)}: {path_problem(cfg.state_dir)}")
    measure = cfg.probes.measure
    budget = cfg.budget.duty_cycle * cfg.schedule.probe_interval_s
    one = measure.warmup_s + measure.window_s
    if budget < one:
        errs.add("budget.duty_cycle",
                 f"{cfg.budget.duty_cycle} x schedule.probe_interval_s "
                 f"{cfg.schedule.probe_interval_s:g} = {budget:g} s per round, less than one "
                 f"probe (probes.measure.warmup_s + window_s = {one:g} s)")
    for i, fake in enumerate(cfg.fake.devices):
        flag = fake.slowdown_when_file
        if flag and path_problem(flag):
            errs.add(f"fake.devices[{i}].slowdown_when_file",
                     f"{_short(flag)}: {path_problem(flag)}")
    if cfg.backend == "fake" and not cfg.fake.devices:
        errs.add("fake.devices", "backend fake needs at least one device")
    least = MIN_WINDOW_S.get(cfg.backend)
    if least is not None and measure.window_s < least:
        counter = ("the fake backend simulates NVML's energy counter, which"
                   if cfg.backend == "fake" else "NVML's energy counter")
        errs.add("probes.measure.window_s",
                 f"{measure.window_s:g} s is too short to resolve a probe's energy: {counter} "
                 f"moves in ~{ENERGY_STEP_S * 1000:.0f} ms steps, so backend {cfg.backend} "
                 f"needs a window of at least {least:g} s")
    _check_memory(cfg, errs)


def _check_memory(cfg: Config, errs: _Errors) -> None:
    """Probes that no device can run: their buffers exceed budget.memory_mb."""
    budget = cfg.budget.memory_mb << 20

    def least(m: int, n: int, k: int, dtypes: tuple[str, ...]) -> tuple[int, str]:
        return min((ProbeSpec(m, n, k, d).buffer_bytes, d) for d in dtypes)

    total = 0
    for g, group in enumerate(cfg.probes.sentinels):
        per_shape = len(group.dtypes) * sum(len(group.layouts) if kern == "blas"
                                            else len(group.tiles) for kern in set(group.kernels))
        total += per_shape * len(set(group.shapes))
        for s, (m, n, k) in enumerate(group.shapes):
            need, dtype = least(m, n, k, group.dtypes)
            if need > budget:
                errs.add(f"probes.sentinels[{g}].shapes[{s}]",
                         f"{m}x{n}x{k} needs {need / 2**20:,.0f} MiB of buffers even in {dtype}, "
                         f"over budget.memory_mb {cfg.budget.memory_mb}: no device could run it")
    if total > MAX_SENTINELS:
        errs.add("probes.sentinels",
                 f"{total:,} probe configurations, more than {MAX_SENTINELS:,}: each runs every "
                 "round and is exported as its own series")
    for g, draws in enumerate(cfg.probes.exploration):
        need, dtype = least(draws.m[0], draws.n[0], draws.k[0], draws.dtypes)
        if draws.per_round and need > budget:
            errs.add(f"probes.exploration[{g}]",
                     f"its smallest shape {draws.m[0]}x{draws.n[0]}x{draws.k[0]} needs "
                     f"{need / 2**20:,.0f} MiB of buffers even in {dtype}, over "
                     f"budget.memory_mb {cfg.budget.memory_mb}: no draw could run")


def _validate(data: Any) -> tuple[Config | None, _Errors]:
    errs = _Errors()
    cfg = _build(Config, data, "", errs)
    return cfg, errs


def _error(source: str, errs: _Errors, root: Any = None) -> ConfigError:
    """One ConfigError for every problem (the first MAX_PROBLEMS, then a count), each with
    its line when the YAML node graph ``root`` is known."""
    shown = errs[:MAX_PROBLEMS]
    lines = _lines(root, [p for p, _ in shown]) if root is not None else {}
    problems = [_problem(p, m, lines.get(p) if p else None) for p, m in shown]
    if len(errs) > MAX_PROBLEMS:
        problems.append(_problem("", f"{len(errs) - MAX_PROBLEMS} more problems not shown"))
    return ConfigError(source, problems)


def parse(data: Any, source: str = "<config>") -> Config:
    """Validate a parsed YAML document. Raises ConfigError listing every problem."""
    cfg, errs = _validate(data)
    if errs or cfg is None:  # None only with errors
        raise _error(source, errs)
    return cfg


def budget_warnings(cfg: Config) -> list[str]:
    """What the duty-cycle budget does to the plan, when it cannot run a whole round: an
    estimate from the window settings (a probe takes at least warmup_s + window_s)."""
    backend = "nvidia" if cfg.backend == "auto" else cfg.backend
    applies = [g for g in cfg.probes.sentinels if not g.backends or backend in g.backends]
    sentinels = sum(len(g.shapes) * len(g.dtypes) * sum(
        len(g.tiles) if k == "tiled" else len(g.layouts) for k in g.kernels) for g in applies)
    explore = sum(e.per_round for e in cfg.probes.exploration
                  if not e.backends or backend in e.backends)
    total = sentinels + explore
    per_probe = cfg.probes.measure.warmup_s + cfg.probes.measure.window_s
    budget = cfg.budget.duty_cycle * cfg.schedule.probe_interval_s
    fit = max(1, int(budget // per_probe))
    if total <= fit:
        return []
    rounds = -(-total // fit)
    return [f"budget: {cfg.budget.duty_cycle:g} x {cfg.schedule.probe_interval_s:g} s = "
            f"{budget:g} s a round fits about {fit} of the {total} probes of a {backend} "
            f"round ({sentinels} sentinels + {explore} exploration, each at least "
            f"warmup_s + window_s = {per_probe:g} s): rounds take turns, so each probe runs "
            f"about every {rounds} rounds ({rounds * cfg.schedule.probe_interval_s:g} s)"]


def warnings(cfg: Config) -> list[str]:
    """What a valid configuration does that its author may not expect: the budget's
    effect on the plan (budget_warnings), and a model that can never be fitted."""
    out = budget_warnings(cfg)
    model = cfg.model
    for limit, name in ((model.max_training_rows, "model.max_training_rows"),
                        (cfg.store.max_rows, "store.max_rows")):
        if limit and model.min_samples > limit:
            out.append(f"model.min_samples {model.min_samples:,} is more than {name} "
                       f"{limit:,}: no refit will ever fit a model (predictions stay "
                       "the roofline estimate or model.reference)")
            break
    return out


def check(cfg: Config, source: str) -> Config:
    """Validate a Config built or changed in code (e.g. by command-line overrides) by the
    same rules as a file: ranges, choices and cross-checks. Raises ConfigError."""
    def plain(v: Any) -> Any:
        if isinstance(v, (tuple, list)):
            return [plain(x) for x in v]
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        return v
    return parse(plain(dataclasses.asdict(cfg)), source)


def load(path: str | Path | None) -> Config:
    """Load a YAML file (None: built-in defaults). Raises ConfigError for every problem:
    unreadable or oversized files, invalid YAML, and invalid values, each with its key path
    and, where known, its line."""
    if path is None:
        return Config()
    source, text = read_file(path)
    data, root = read_yaml(text, source)
    listen = data.get("listen") if isinstance(data, dict) else None
    web = listen.get("web_config_file") if isinstance(listen, dict) else None
    if isinstance(listen, dict) and isinstance(web, str) and web and \
            not Path(web).is_absolute():
        listen["web_config_file"] = str(Path(path).parent / web)  # relative to this file
    cfg, errs = _validate(data)
    if errs or cfg is None:  # None only with errors
        raise _error(source, errs, root)
    return cfg
