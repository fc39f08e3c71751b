"""Load and validate gemmd.yaml into frozen dataclasses.

Validation runs once, at start-up: every problem is collected with its key path
(``probes.sentinels[1].dtypes[0]``) and reported together in one ConfigError.
"""

from __future__ import annotations

import dataclasses
import math
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from gemmd.errors import ConfigError

DTYPES = ("fp64", "fp32", "tf32", "fp16", "bf16", "fp8")
KERNELS = ("blas", "tiled")
LAYOUTS = ("nn", "nt", "tn", "tt")
BACKENDS = ("auto", "nvidia", "cpu", "fake")


def _f(default: Any, **meta: Any) -> Any:
    """A field with validation metadata (min, max, choices, doc)."""
    if isinstance(default, (list, dict)):
        raise TypeError("use tuples for defaults")
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class ListenConfig:
    address: str = _f("0.0.0.0")
    port: int = _f(9477, min=0, max=65535)


@dataclass(frozen=True)
class ProbeGroup:
    """A cartesian product of probe configurations, repeated every round."""

    shapes: tuple[tuple[int, int, int], ...] = _f(((1024, 1024, 1024),), min=1, max=1 << 20)
    dtypes: tuple[str, ...] = _f(("fp32",), choices=DTYPES)
    kernels: tuple[str, ...] = _f(("blas",), choices=KERNELS)
    # Tile edge of the paper's naive tiled kernel; ignored for blas.
    tiles: tuple[int, ...] = _f((16,), min=1, max=32)
    layouts: tuple[str, ...] = _f(("nn",), choices=LAYOUTS)
    # Backends this group applies to; empty means every backend.
    backends: tuple[str, ...] = _f((), choices=BACKENDS[1:])


@dataclass(frozen=True)
class ExplorationConfig:
    """Random shapes per round (stored for training, never exported as labels)."""

    per_round: int = _f(2, min=0, max=1000)
    m: tuple[int, int] = _f((256, 4096), min=1, max=1 << 20)
    n: tuple[int, int] = _f((256, 4096), min=1, max=1 << 20)
    k: tuple[int, int] = _f((256, 4096), min=1, max=1 << 20)
    align: int = _f(64, min=1, max=4096)
    dtypes: tuple[str, ...] = _f(("fp32",), choices=DTYPES)
    kernels: tuple[str, ...] = _f(("blas",), choices=KERNELS)
    tiles: tuple[int, ...] = _f((16,), min=1, max=32)
    layouts: tuple[str, ...] = _f(("nn",), choices=LAYOUTS)
    backends: tuple[str, ...] = _f((), choices=BACKENDS[1:])


@dataclass(frozen=True)
class MeasureConfig:
    warmup_s: float = _f(0.1, min=0.0, max=60.0)
    warmup_iters: int = _f(2, min=1, max=10000)
    window_s: float = _f(1.0, min=0.001, max=60.0)
    min_iters: int = _f(3, min=1, max=1_000_000)
    max_iters: int = _f(100_000, min=1, max=100_000_000)
    # Compare a probe's output with a reference every N probes of the same spec (0 = never).
    check_every: int = _f(10, min=0, max=1_000_000)
    # A probe still running after this long is declared hung and its device marked down.
    timeout_s: float = _f(120.0, min=1.0, max=3600.0)


# The default plan (identical to gemmd.yaml): compute-bound cuBLAS GEMMs and the paper's
# tiled kernel on GPUs; small fp32 BLAS GEMMs on a CPU.
_GPU = ("nvidia", "fake")
DEFAULT_SENTINELS = (
    ProbeGroup(shapes=((4096, 4096, 4096), (8192, 8192, 8192)), dtypes=("bf16", "fp32"),
               kernels=("blas",), layouts=("nn",), backends=_GPU),
    ProbeGroup(shapes=((1024, 1024, 1024),), dtypes=("fp32",), kernels=("tiled",),
               tiles=(16, 32), backends=_GPU),
    ProbeGroup(shapes=((512, 512, 512), (1024, 1024, 1024)), dtypes=("fp32",),
               kernels=("blas",), backends=("cpu",)),
)
DEFAULT_EXPLORATION = (
    ExplorationConfig(per_round=1, m=(256, 8192), n=(256, 8192), k=(256, 8192), align=64,
                      dtypes=("bf16", "fp16", "fp32"), backends=_GPU),
    ExplorationConfig(per_round=1, m=(128, 1024), n=(128, 1024), k=(128, 1024), align=64,
                      dtypes=("fp32", "fp64"), backends=("cpu",)),
)


@dataclass(frozen=True)
class ProbesConfig:
    sentinels: tuple[ProbeGroup, ...] = _f(DEFAULT_SENTINELS)
    exploration: tuple[ExplorationConfig, ...] = _f(DEFAULT_EXPLORATION)
    measure: MeasureConfig = _f(MeasureConfig())


@dataclass(frozen=True)
class ScheduleConfig:
    probe_interval_s: float = _f(120.0, min=1.0, max=86400.0)
    refit_interval_s: float = _f(3600.0, min=10.0, max=30 * 86400.0)
    # Skip a round when other processes use the device (do no harm).
    skip_when_busy: bool = _f(True)
    # Consecutive failed rounds before a device is marked down; retried with backoff.
    max_failures: int = _f(3, min=1, max=1000)
    max_backoff_s: float = _f(3600.0, min=1.0, max=86400.0)


@dataclass(frozen=True)
class BudgetConfig:
    # Fraction of wall time a device may spend probing (per probe interval).
    duty_cycle: float = _f(0.1, min=0.0001, max=1.0)
    memory_mb: int = _f(2048, min=1, max=1 << 24)


@dataclass(frozen=True)
class ModelConfig:
    min_samples: int = _f(30, min=2, max=10_000_000)
    n_estimators: int = _f(100, min=1, max=5000)
    max_depth: int = _f(0, min=0, max=200)  # 0 = unlimited
    min_samples_leaf: int = _f(2, min=1, max=10000)
    interval: float = _f(0.9, min=0.5, max=0.999)
    keep: int = _f(5, min=1, max=1000)
    # Before enough samples exist, predicted runtime = roofline bound / this efficiency.
    roofline_efficiency: float = _f(0.7, min=0.01, max=1.0)
    seed: int = _f(0, min=0, max=2**31 - 1)


@dataclass(frozen=True)
class DriftConfig:
    """CUSUM on model residuals; see gemmd/drift.py for the arithmetic."""

    shift: float = _f(0.05, min=0.001, max=10.0)  # relative change to detect (0.05 = 5%)
    # Healthy results between false alarms of one probe x target, on average.
    arl0: float = _f(5e6, min=10.0, max=1e15)
    baseline_probes: int = _f(10, min=2, max=10000)
    min_scale: float = _f(0.01, min=0.0001, max=1.0)  # floor of the residual scale (log)
    accept_after_s: float = _f(0.0, min=0.0, max=1e9)  # 0 = wait for `gemmd rebaseline`
    targets: tuple[str, ...] = _f(("runtime", "power", "energy"),
                                  choices=("runtime", "power", "energy"))


@dataclass(frozen=True)
class StoreConfig:
    retention_days: float = _f(90.0, min=0.01, max=36500.0)
    max_rows: int = _f(1_000_000, min=100, max=1_000_000_000)


@dataclass(frozen=True)
class FakeDeviceConfig:
    """One simulated GPU; faults are off unless set."""

    model: str = _f("H100-SXM", choices=("H100-SXM", "A100-SXM", "RTX4070", "L4"))
    slowdown_factor: float = _f(1.0, min=0.01, max=1000.0)
    slowdown_after_s: float = _f(0.0, min=0.0, max=1e9)
    fail_on_call: int = _f(0, min=0, max=1 << 40)  # 0 = never
    # From this call on, a sticky CUDA error (illegal address): the context is unusable.
    fault_on_call: int = _f(0, min=0, max=1 << 40)
    hang_on_call: int = _f(0, min=0, max=1 << 40)
    busy: bool = _f(False)


@dataclass(frozen=True)
class FakeConfig:
    devices: tuple[FakeDeviceConfig, ...] = _f((FakeDeviceConfig(), FakeDeviceConfig()))
    seed: int = _f(0, min=0, max=2**31 - 1)
    noise: float = _f(0.01, min=0.0, max=1.0)  # lognormal sigma of runtime
    # Lognormal sigma of a factor drawn per run() call: real GEMM times vary more between
    # runs (clocks, temperature) than within one.
    jitter: float = _f(0.0, min=0.0, max=1.0)
    # Sleep for the simulated time (demos); tests run on simulated time only.
    realtime: bool = _f(False)


@dataclass(frozen=True)
class Config:
    listen: ListenConfig = _f(ListenConfig())
    # "auto": $STATE_DIRECTORY (systemd), else $XDG_STATE_HOME/gemmd, else ~/.local/state/gemmd.
    state_dir: str = _f("auto")
    backend: str = _f("auto", choices=BACKENDS)
    # "all", or a list of device indices / UUIDs.
    devices: str | tuple[int | str, ...] = _f("all")
    probes: ProbesConfig = _f(ProbesConfig())
    schedule: ScheduleConfig = _f(ScheduleConfig())
    budget: BudgetConfig = _f(BudgetConfig())
    model: ModelConfig = _f(ModelConfig())
    drift: DriftConfig = _f(DriftConfig())
    store: StoreConfig = _f(StoreConfig())
    fake: FakeConfig = _f(FakeConfig())
    log_level: str = _f("info", choices=("debug", "info", "warning", "error"))
    # Where probes run: "process" (a worker per device: a hang or a broken CUDA context is
    # killed and restarted), "thread" (in the daemon), or "auto" (process for nvidia).
    isolation: str = _f("auto", choices=("auto", "process", "thread"))

    def resolved_state_dir(self) -> Path:
        if self.state_dir != "auto":
            return Path(self.state_dir).expanduser()
        if os.environ.get("STATE_DIRECTORY"):
            return Path(os.environ["STATE_DIRECTORY"].split(":")[0])
        base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
        return Path(base) / "gemmd"


# ---------------------------------------------------------------- validation


class _Errors(list):
    def add(self, path: str, msg: str) -> None:
        self.append(f"{path or '<top>'}: {msg}")


def _typename(v: Any) -> str:
    return {dict: "mapping", list: "list", str: "string", bool: "boolean", int: "integer",
            float: "number", type(None): "null"}.get(type(v), type(v).__name__)


def _convert(value: Any, tp: Any, meta: dict, path: str, errs: _Errors) -> Any:
    """Convert a YAML value to ``tp``; record errors and return a placeholder on failure."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, path, errs)
    if origin in (typing.Union, types.UnionType):
        alts = typing.get_args(tp)
        # Try each alternative silently; report against the first that fits the YAML kind.
        for alt in alts:
            trial = _Errors()
            out = _convert(value, alt, meta, path, trial)
            if not trial:
                return out
            if isinstance(value, list) and typing.get_origin(alt) is tuple:
                errs.extend(trial)  # a list was meant: say which item is wrong
                return None
        errs.add(path, f"expected {' or '.join(_describe(a) for a in alts)}, got "
                       f"{_typename(value)} {value!r}")
        return None
    if origin is tuple:
        args = typing.get_args(tp)
        if not isinstance(value, (list, tuple)):
            errs.add(path, f"expected a list, got {_typename(value)} {value!r}")
            return None
        if len(args) == 2 and args[1] is Ellipsis:
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
            errs.add(path, f"expected true or false, got {_typename(value)} {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            errs.add(path, f"expected an integer, got {_typename(value)} {value!r}")
            return value
        _check_range(value, meta, path, errs)
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            errs.add(path, f"expected a number, got {_typename(value)} {value!r}")
            return value
        if not math.isfinite(value):
            errs.add(path, f"{value} is not a finite number")
            return value
        _check_range(float(value), meta, path, errs)
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            errs.add(path, f"expected a string, got {_typename(value)} {value!r}")
            return value
        choices = meta.get("choices")
        if choices and value not in choices:
            errs.add(path, f"{value!r} is not one of {', '.join(choices)}")
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
        errs.add(path, f"{v} is below the minimum {lo}")
    elif hi is not None and v > hi:
        errs.add(path, f"{v} is above the maximum {hi}")


def _build(cls: type, data: Any, path: str, errs: _Errors) -> Any:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        errs.add(path, f"expected a mapping, got {_typename(data)} {data!r}")
        return cls()
    before = len(errs)
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in data:
        if key not in fields:
            known = ", ".join(sorted(fields))
            errs.add(_join(path, str(key)), f"unknown key (known keys: {known})")
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


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _cross_checks(obj: Any, path: str, errs: _Errors) -> None:
    """Checks that involve more than one field of one section."""
    if isinstance(obj, ExplorationConfig):
        for dim in ("m", "n", "k"):
            lo, hi = getattr(obj, dim)
            if lo > hi:
                errs.add(_join(path, dim), f"range [{lo}, {hi}] is empty (min > max)")
    if isinstance(obj, MeasureConfig) and obj.min_iters > obj.max_iters:
        errs.add(_join(path, "min_iters"),
                 f"{obj.min_iters} is greater than max_iters {obj.max_iters}")
    if isinstance(obj, (ProbeGroup, ExplorationConfig)):
        for name in ("dtypes", "kernels", "layouts", "tiles"):
            if not getattr(obj, name):
                errs.add(_join(path, name), "must not be empty")
    if isinstance(obj, ProbeGroup) and not obj.shapes:
        errs.add(_join(path, "shapes"), "must not be empty")
    if isinstance(obj, Config):
        if isinstance(obj.devices, str) and obj.devices != "all":
            errs.add("devices", f"{obj.devices!r} is not 'all' or a list of indices/UUIDs")
        budget = obj.budget.duty_cycle * obj.schedule.probe_interval_s
        one = obj.probes.measure.warmup_s + obj.probes.measure.window_s
        if budget < one:
            errs.add("budget.duty_cycle",
                     f"{obj.budget.duty_cycle} x schedule.probe_interval_s "
                     f"{obj.schedule.probe_interval_s:g} = {budget:g} s per round, less than one "
                     f"probe (probes.measure.warmup_s + window_s = {one:g} s)")
        if obj.backend == "fake" and not obj.fake.devices:
            errs.add("fake.devices", "backend fake needs at least one device")


def parse(data: Any, source: str = "<config>") -> Config:
    """Validate a parsed YAML document. Raises ConfigError listing every problem."""
    errs = _Errors()
    cfg = _build(Config, data, "", errs)
    if errs:
        raise ConfigError(source, list(errs))
    return cfg


def load(path: str | Path | None) -> Config:
    """Load a YAML file (None: built-in defaults)."""
    if path is None:
        return Config()
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(str(p), [f"cannot read: {e.strerror or e}"]) from e
    except UnicodeDecodeError as e:
        raise ConfigError(str(p), [f"not UTF-8 text: {e}"]) from e
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(str(p), [f"{where}invalid YAML: {problem}"]) from e
    return parse(data, str(p))
