"""Load and validate gemmd.yaml into frozen dataclasses.

Validation runs once, at start-up: every problem is collected with its key path
(``probes.sentinels[1].dtypes[0]``) and, for a file, its line, and reported together in one
ConfigError. Hostile input (device files, deep nesting, alias bombs, huge integers, NULs,
duplicate keys) is refused the same way, within bounds of size and time (see "limits").
"""

from __future__ import annotations

import dataclasses
import functools
import ipaddress
import math
import os
import re
import reprlib
import tempfile
import time
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from gemmd.errors import ConfigError
from gemmd.gemm import DTYPES, KERNELS, LAYOUTS, ProbeSpec

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
    # TLS and basic auth: a Prometheus exporter-toolkit web configuration file (the format
    # of node_exporter's and dcgm-exporter's --web.config.file); relative to this file.
    # Empty: plain HTTP, no authentication.
    web_config_file: str = _f("")


@dataclass(frozen=True, kw_only=True)
class _Variants:
    """What a group of probes runs besides its shapes: every combination of these."""

    dtypes: tuple[str, ...] = _f(("fp32",), choices=DTYPES)
    kernels: tuple[str, ...] = _f(("blas",), choices=KERNELS)
    # Tile edge of the paper's naive tiled kernel; ignored for blas.
    tiles: tuple[int, ...] = _f((16,), min=1, max=32)
    layouts: tuple[str, ...] = _f(("nn",), choices=LAYOUTS)
    # Backends this group applies to; empty means every backend.
    backends: tuple[str, ...] = _f((), choices=BACKENDS[1:])


@dataclass(frozen=True, kw_only=True)
class ProbeGroup(_Variants):
    """A cartesian product of probe configurations, repeated every round."""

    shapes: tuple[tuple[int, int, int], ...] = _f(((1024, 1024, 1024),), min=1, max=1 << 20)


@dataclass(frozen=True, kw_only=True)
class ExplorationConfig(_Variants):
    """Random shapes per round (stored for training, never exported as labels)."""

    per_round: int = _f(2, min=0, max=1000)
    m: tuple[int, int] = _f((256, 4096), min=1, max=1 << 20)
    n: tuple[int, int] = _f((256, 4096), min=1, max=1 << 20)
    k: tuple[int, int] = _f((256, 4096), min=1, max=1 << 20)
    align: int = _f(64, min=1, max=4096)


@dataclass(frozen=True)
class MeasureConfig:
    # The defaults cost ~0.62-0.70 s of GPU time per 8192^3 sentinel on an H200 (measured,
    # bench/RESULTS.md): 0.5 s is the shortest window the 100 ms energy counter resolves
    # (~2% energy CV; 1 s: 0.2-0.6%), and probes of a round warm each other up.
    warmup_s: float = _f(0.02, min=0.0, max=60.0)
    warmup_iters: int = _f(2, min=1, max=10000)
    window_s: float = _f(0.5, min=0.001, max=60.0)
    min_iters: int = _f(3, min=1, max=1_000_000)
    max_iters: int = _f(100_000, min=1, max=100_000_000)
    # Compare a probe's output with a reference every N probes of the same spec (0 = never).
    check_every: int = _f(10, min=0, max=1_000_000)
    # A probe still running after this long is declared hung and its device marked down.
    timeout_s: float = _f(120.0, min=1.0, max=3600.0)


# The default plan (identical to gemmd.yaml): two compute-bound cuBLAS GEMMs on GPUs, one
# of each way a GPU slows down (issue 23, measured on an H200): bf16 runs at the power cap
# (a lowered power limit or more power per clock slows it), fp32 at full clock (a clock
# cap slows it); together ~1.37 s of GPU time per 120 s round. Small fp32 BLAS GEMMs on a
# CPU.
_GPU = ("nvidia", "fake")
DEFAULT_SENTINELS = (
    ProbeGroup(shapes=((8192, 8192, 8192),), dtypes=("bf16", "fp32"),
               kernels=("blas",), layouts=("nn",), backends=_GPU),
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
    # A GPU counts as busy when its utilization (over NVML's last sample period) reaches
    # this fraction, or when other processes hold this much of its memory. The memory
    # signal sees other containers' work, which NVML's process list does not.
    busy_utilization: float = _f(0.10, min=0.01, max=1.0)
    busy_memory_mb: int = _f(256, min=0, max=1 << 30)  # 0: memory is not a signal
    # After a round skipped because the device was busy, try again soon: 5 s, then twice
    # as long each time up to this (when it is sooner than the next round); 0 = wait for
    # the next round.
    busy_retry_s: float = _f(30.0, min=0.0, max=86400.0)
    # CPU backend only (a trial run, no GPU to protect): after skipping rounds as busy for
    # this long, probe anyway, timing the contention (logged); 0 = wait as long as it takes.
    busy_max_wait_s: float = _f(30.0, min=0.0, max=86400.0)
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
    # Most leaves per tree (0 = unlimited): bounds a forest's memory whatever the store
    # holds, about n_estimators x 2 x this x 112 bytes per target (bench/RESULTS.md,
    # "Memory over a week"); trees grow best-first, the most useful splits first.
    max_leaf_nodes: int = _f(4096, min=0, max=10_000_000)
    interval: float = _f(0.9, min=0.5, max=0.999)
    keep: int = _f(5, min=1, max=1000)
    # Before enough samples exist, predicted runtime = roofline bound / this efficiency.
    roofline_efficiency: float = _f(0.7, min=0.01, max=1.0)
    seed: int = _f(0, min=0, max=2**31 - 1)
    # Most stored probes one refit reads (bounds its memory and time whatever
    # store.max_rows is; each configuration keeps its newest repeats). 0 = no cap.
    max_training_rows: int = _f(200_000, min=0, max=100_000_000)
    # A fleet's reference model (a file `gemmd fit` wrote from many hosts' exports): each
    # GPU is then predicted by it, calibrated on that GPU's own probes, until and beside
    # its own forest. Its sha256 pins the file (recommended for files that travel).
    reference: str = _f("")
    reference_sha256: str = _f("")


@dataclass(frozen=True)
class DriftConfig:
    """CUSUMs on pre-whitened model residuals, per probe and pooled per device, and the
    comparison with same-model peers; see docs/drift.md and gemmd/drift.py."""

    shift: float = _f(0.05, min=0.001, max=10.0)  # relative change to detect (0.05 = 5%)
    # Healthy results between false alarms of one CUSUM (a probe x target, or a device's
    # pooled statistic for a target), on average.
    arl0: float = _f(2e6, min=10.0, max=1e15)
    baseline_probes: int = _f(10, min=2, max=10000)
    min_scale: float = _f(0.01, min=0.0001, max=1.0)  # floor of the residual scale (log)
    accept_after_s: float = _f(0.0, min=0.0, max=1e9)  # 0 = wait for `gemmd rebaseline`
    targets: tuple[str, ...] = _f(("runtime", "power", "energy"),
                                  choices=("runtime", "power", "energy"))
    # Slower than its same-model siblings on the host by more than this (0.03 = 3%), with
    # at least peer_min_siblings of them to compare with: gemmd_device_slower_than_peers.
    peer_margin: float = _f(0.03, min=0.001, max=10.0)
    peer_min_siblings: int = _f(2, min=1, max=10000)
    # Slow wiggles (a daily temperature cycle, slowly wandering clocks) below this amplitude
    # are not faults (0.02 = 2%); a change that holds above it for hours is, and `shift`
    # is caught within rounds. Below `shift`; 0: no slow-level alarm, and no tolerance.
    tolerance: float = _f(0.02, min=0.0, max=10.0)


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
    # Other work the busy check should see: utilization (0..1) and memory held by others.
    other_utilization: float = _f(0.0, min=0.0, max=1.0)
    other_memory_mb: int = _f(0, min=0, max=1 << 30)
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
class MetricsConfig:
    """What /metrics exports (docs/deploy.md, "Metrics and series")."""

    # lean: the series the shipped rules and dashboards read (about 50 per GPU with the
    # default plan); full: every series, the drift detector's internals included (debugging).
    profile: str = _f("lean", choices=("lean", "full"))
    # The `hostname` label on every series: "auto" = $NODE_NAME (Kubernetes: the node the
    # pod runs on), else the host's name; or the name to use.
    hostname: str = _f("auto")


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
    metrics: MetricsConfig = _f(MetricsConfig())
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


# ---------------------------------------------------------------- limits

# A configuration is a few kilobytes; these bounds only stop hostile or broken input (a
# device file, an alias bomb, a runaway generator) before it costs time or memory.
MAX_FILE_BYTES = 1 << 20  # read at most this much of a file
MAX_DEPTH = 32  # nesting of lists and mappings (gemmd's own schema needs 6)
MAX_VALUES = 100_000  # values in the document once YAML aliases are expanded
MAX_INT_CHARS = 100  # characters of an integer literal (Python's int() refuses > 4,300)
MAX_PARSE_S = 5.0  # wall time for reading the YAML
# The clock MAX_PARSE_S is measured on; tests put their own here rather than race it.
clock: Callable[[], float] = time.monotonic
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


def _problem(path: str, msg: str, line: int | None = None) -> str:
    where = f" (line {line})" if line else ""
    return f"{path or '<top>'}: {msg}{where}"


_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 80
_REPR.maxlong = 40
_REPR.maxlevel = 3
_REPR.maxlist = _REPR.maxtuple = _REPR.maxset = _REPR.maxfrozenset = 6
_REPR.maxdict = 4


def _short(v: Any) -> str:
    """repr() bounded in length and work: values in messages may be huge or deep."""
    if isinstance(v, int) and not isinstance(v, bool) and v.bit_length() > 128:
        return f"<an integer of ~{int(v.bit_length() * math.log10(2)) + 1} digits>"
    try:
        return _REPR.repr(v)
    except (ValueError, RecursionError):  # a huge integer inside a container
        return f"<a {_typename(v)}>"


def _key_text(key: Any) -> str:
    s = key if isinstance(key, str) else _short(key)
    return s if len(s) <= 80 else s[:77] + "..."


def _typename(v: Any) -> str:
    return {dict: "mapping", list: "list", str: "string", bool: "boolean", int: "integer",
            float: "number", type(None): "null"}.get(type(v), type(v).__name__)


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


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


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
    """The web configuration file is checked with the configuration (imported only when
    one is named: the exporter's HTTP side is not needed otherwise)."""
    from gemmd.exporter.http import load_web_config

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


def file_sha256(path: str | Path) -> str:
    """The sha256 of a file's bytes (model files and their pins). Raises OSError."""
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


NAME_MAX, PATH_MAX = 255, 4096  # bytes in one file name and in a whole path (Linux)


def shown(text: str, limit: int = 80) -> str:
    """A value as an error message quotes it: at most ``limit`` characters."""
    return text if len(text) <= limit else f"{text[:limit - 25]}... ({len(text):,} characters)"


def cannot_write_in(directory: Path) -> str | None:
    """Why no file can be made in ``directory`` (strerror), or None. Makes and removes a
    file: the one reliable test (root passes os.access on /proc and /sys)."""
    try:
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".gemmd-", suffix=".tmp")
        os.close(fd)
        os.unlink(tmp)
    except OSError as e:
        return str(e.strerror or e)
    return None


def path_problem(text: str) -> str | None:
    """Why ``text`` cannot name a file (a NUL, a name or path longer than Linux allows),
    or None. Checked before any stat(): those raise on such names instead of answering."""
    if "\0" in text:
        return "contains a NUL character"
    raw = os.fsencode(text)
    if len(raw) >= PATH_MAX:
        return f"a path of {len(raw):,} bytes is longer than the {PATH_MAX - 1:,} allowed"
    longest = max(raw.split(b"/"), key=len)
    if len(longest) > NAME_MAX:
        return (f"a file name of {len(longest):,} bytes is longer than the {NAME_MAX} "
                "allowed")
    return None


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


# ---------------------------------------------------------------- reading YAML


class _DocError(Exception):
    """A problem found while reading the YAML, at a key path and a position."""

    def __init__(self, path: str, msg: str, mark: Any = None, node: Any = None):
        super().__init__(msg)
        self.path, self.msg, self.mark, self.node = path, msg, mark, node


# libyaml's parser (C) when PyYAML was built with it: 10-50x faster than the pure-Python
# one. Its own composer is recursive C code that overflows the stack on deep nesting, so
# gemmd composes the node graph itself from the parser's events (_compose).
_MERGE_TAG = "tag:yaml.org,2002:merge"


class _Constructor:
    """SafeConstructor's behaviour, minus its tracebacks (a mixin for either parser)."""

    def construct_object(self, node: Any, deep: bool = False) -> Any:
        try:
            return super().construct_object(node, deep)  # type: ignore[misc]
        except (yaml.YAMLError, _DocError):
            raise
        except Exception as e:  # noqa: BLE001 - each is the input's fault, not gemmd's
            # PyYAML's constructors let ValueError (a date that does not exist: 2024-13-01),
            # IndexError (!!int "") or AttributeError (!!timestamp x) through.
            tag = node.tag.rsplit(":", 1)[-1]
            what = _short(node.value) if isinstance(node, yaml.ScalarNode) else "this value"
            raise _DocError("", f"cannot read {what} as a {tag}: {e}", node.start_mark,
                            node) from e

    def construct_yaml_int(self: Any, node: Any) -> Any:  # self: a loader with this mixin
        text = str(node.value)
        if len(text) > MAX_INT_CHARS:
            raise _DocError("", f"integer of {len(text):,} characters: out of any range",
                            node.start_mark, node)
        return super().construct_yaml_int(node)  # type: ignore[misc]


class _PyLoader(_Constructor, yaml.SafeLoader):
    pass


_PyLoader.add_constructor("tag:yaml.org,2002:int", _PyLoader.construct_yaml_int)
if hasattr(yaml, "CSafeLoader"):
    class _CLoader(_Constructor, yaml.CSafeLoader):  # type: ignore[name-defined]
        pass

    _CLoader.add_constructor("tag:yaml.org,2002:int", _CLoader.construct_yaml_int)
    _Loader: type = _CLoader
else:  # pragma: no cover - PyYAML without libyaml
    _Loader = _PyLoader


class _Frame:
    __slots__ = ("node", "start", "keys", "key", "merge", "anchored")

    def __init__(self, node: Any, start: int, is_map: bool, anchored: bool):
        self.node, self.start, self.anchored = node, start, anchored
        self.keys: dict | None = {} if is_map else None
        self.key: Any = None
        self.merge = 0


def _path_of(stack: list[_Frame]) -> str:
    path = ""
    for f in stack:
        if f.keys is None:
            path += f"[{len(f.node.value)}]"
        elif f.key is not None:
            key = f.key.value if isinstance(f.key, yaml.ScalarNode) else "?"
            path = _join(path, _key_text(key))
    return path


def _compose(loader: Any, deadline: float) -> Any:
    """The document's root node (None for an empty stream), built without recursion.

    Refuses nesting deeper than MAX_DEPTH, more than MAX_VALUES values once aliases are
    expanded (an alias bomb), recursive aliases, duplicate keys, merge-key chains deeper
    than MAX_DEPTH and documents that take longer than MAX_PARSE_S to read.
    """
    get, resolve = loader.get_event, loader.resolve
    get()  # StreamStartEvent
    ev = get()
    if isinstance(ev, yaml.StreamEndEvent):
        return None
    anchors: dict[str, Any] = {}
    sizes: dict[int, int] = {}  # id(anchored node) -> values it expands to, once complete
    merges: dict[int, int] = {}  # id(mapping) -> depth of its merge-key (<<) chain
    stack: list[_Frame] = []
    root, count, events = None, 0, 0
    node: yaml.Node | None  # None: only until an alias is checked
    while True:
        ev = get()
        events += 1
        if not events & 1023 and clock() > deadline:
            raise _DocError(_path_of(stack), f"reading took longer than {MAX_PARSE_S:g} s",
                            ev.start_mark)
        cls = type(ev)
        if cls is yaml.ScalarEvent:
            tag = ev.tag
            if tag is None or tag == "!":
                tag = resolve(yaml.ScalarNode, ev.value, ev.implicit)
            node = yaml.ScalarNode(tag, ev.value, ev.start_mark, ev.end_mark, style=ev.style)
            count += 1
            if ev.anchor is not None:
                _anchor(anchors, ev, node, stack)
                sizes[id(node)] = 1
        elif cls is yaml.AliasEvent:
            node = anchors.get(ev.anchor)
            if node is None:
                raise _DocError(_path_of(stack), f"undefined alias *{_key_text(ev.anchor)}",
                                ev.start_mark)
            size = sizes.get(id(node))
            if size is None:
                raise _DocError(_path_of(stack), f"alias *{_key_text(ev.anchor)} refers to "
                                "a node that contains it (a recursive structure)",
                                ev.start_mark)
            count += size
            if count > MAX_VALUES:
                raise _DocError(_path_of(stack), f"aliases expand the document beyond "
                                f"{MAX_VALUES:,} values (an alias bomb?)", ev.start_mark)
        elif cls is yaml.SequenceStartEvent or cls is yaml.MappingStartEvent:
            if len(stack) >= MAX_DEPTH:
                raise _DocError(_path_of(stack), f"nested deeper than {MAX_DEPTH} levels",
                                ev.start_mark)
            kind = yaml.SequenceNode if cls is yaml.SequenceStartEvent else yaml.MappingNode
            tag = ev.tag
            if tag is None or tag == "!":
                tag = resolve(kind, None, ev.implicit)
            node = kind(tag, [], ev.start_mark, None, flow_style=ev.flow_style)
            if ev.anchor is not None:
                _anchor(anchors, ev, node, stack)
            stack.append(_Frame(node, count, kind is yaml.MappingNode, ev.anchor is not None))
            count += 1
            continue
        elif cls is yaml.SequenceEndEvent or cls is yaml.MappingEndEvent:
            frame = stack.pop()
            node = frame.node
            node.end_mark = ev.end_mark
            if frame.anchored:
                sizes[id(node)] = count - frame.start
            if frame.merge:
                merges[id(node)] = frame.merge
        elif cls is yaml.DocumentEndEvent:
            break
        else:  # pragma: no cover - the parser guarantees the event grammar
            raise _DocError(_path_of(stack), f"unexpected {cls.__name__}", ev.start_mark)
        if count > MAX_VALUES:
            raise _DocError(_path_of(stack), f"more than {MAX_VALUES:,} values: not a "
                            "configuration file", ev.start_mark)
        if not stack:
            root = node
            continue
        top = stack[-1]
        if top.keys is None:
            top.node.value.append(node)
        elif top.key is None:
            top.key = node
            _check_key(top, node, stack)
        else:
            if isinstance(top.key, yaml.ScalarNode) and top.key.tag == _MERGE_TAG:
                top.merge = max(top.merge, _merge_depth(node, merges, stack))
            top.node.value.append((top.key, node))
            top.key = None
    ev = get()
    if not isinstance(ev, yaml.StreamEndEvent):
        raise _DocError("", "a second YAML document in the file (only one is read)",
                        ev.start_mark)
    return root


def _anchor(anchors: dict, ev: Any, node: Any, stack: list[_Frame]) -> None:
    if ev.anchor in anchors:
        first = anchors[ev.anchor].start_mark.line + 1
        raise _DocError(_path_of(stack), f"anchor &{_key_text(ev.anchor)} defined twice "
                        f"(first at line {first})", ev.start_mark)
    anchors[ev.anchor] = node


def _check_key(top: _Frame, key: Any, stack: list[_Frame]) -> None:
    """Refuse a key given twice in one mapping: YAML loaders keep the last silently."""
    if isinstance(key, yaml.ScalarNode):
        if key.tag == _MERGE_TAG:
            return
        ident: Any = (key.tag, key.value)
    else:
        ident = id(key)
    assert top.keys is not None
    first = top.keys.get(ident)
    if first is not None:
        raise _DocError(_path_of(stack), f"duplicate key (lines {first.start_mark.line + 1} "
                        f"and {key.start_mark.line + 1}): the second would silently replace "
                        "the first")
    top.keys[ident] = key


def _merge_depth(value: Any, merges: dict[int, int], stack: list[_Frame]) -> int:
    """Depth of the merge-key chain a '<<: value' pair adds (PyYAML flattens recursively)."""
    items = value.value if isinstance(value, yaml.SequenceNode) else [value]
    depth = 1 + max((merges.get(id(v), 0) for v in items), default=0)
    if depth > MAX_DEPTH:
        raise _DocError(_path_of(stack), f"merge keys (<<) chained deeper than {MAX_DEPTH}",
                        value.start_mark)
    return depth


def _find(root: Any, target: Any) -> str:
    """The key path of node ``target`` in the node graph ("" if not found)."""
    todo: list[tuple[Any, str]] = [(root, "")] if root is not None else []
    seen: set[int] = set()
    while todo:
        node, at = todo.pop()
        if node is target:
            return at
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, yaml.SequenceNode):
            todo.extend((v, f"{at}[{i}]") for i, v in enumerate(node.value))
        elif isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                if k is target:
                    return at
                key = k.value if isinstance(k, yaml.ScalarNode) else "?"
                todo.append((v, _join(at, _key_text(key))))
    return ""


def _lines(root: Any, paths: list[str]) -> dict[str, int]:
    """{key path: line} for those of ``paths`` found in the node graph: one walk along
    the wanted paths only (a mapping's line is its key's)."""
    wanted = set(paths)
    prefixes = {p[:i] for p in wanted for i in range(len(p) + 1)}
    out: dict[str, int] = {}
    todo: list[tuple[Any, str, int]] = [(root, "", root.start_mark.line + 1)]
    while todo:
        node, at, line = todo.pop()
        if at in wanted:
            out.setdefault(at, line)
        if isinstance(node, yaml.SequenceNode):
            for i, v in enumerate(node.value):
                if (p := f"{at}[{i}]") in prefixes:
                    todo.append((v, p, v.start_mark.line + 1))
        elif isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                key = k.value if isinstance(k, yaml.ScalarNode) else "?"
                if (p := _join(at, _key_text(key))) in prefixes:
                    todo.append((v, p, k.start_mark.line + 1))
    return out


def read_file(path: str | Path) -> tuple[str, str]:
    """(source name, text) of a configuration file (gemmd.yaml, --web.config.file,
    --gpu-spec), read within MAX_FILE_BYTES: ConfigError for anything else."""
    source = str(path)
    if not source:
        raise ConfigError("''", ["cannot read: the file name is empty"])
    try:
        # O_NONBLOCK: open() of a FIFO would wait for a writer forever (issue 24).
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        with open(fd, "rb") as f:  # not read_text: /dev/zero would never end
            import stat

            if stat.S_ISFIFO(os.fstat(fd).st_mode) or stat.S_ISSOCK(os.fstat(fd).st_mode):
                raise ConfigError(source, ["cannot read: a named pipe or socket, not a file"])
            os.set_blocking(fd, True)
            raw = f.read(MAX_FILE_BYTES + 1)
    except OSError as e:
        raise ConfigError(source, [f"cannot read: {e.strerror or e}"]) from e
    except ValueError as e:  # a NUL in the file name
        raise ConfigError(source, [f"cannot read: {e}"]) from e
    if len(raw) > MAX_FILE_BYTES:
        raise ConfigError(source, [f"larger than {MAX_FILE_BYTES >> 10} KiB: not a "
                                   "configuration file"])
    try:
        return source, raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        raise ConfigError(source, [f"not UTF-8 text (line {line}): {e}"]) from e


def read_yaml(text: str, source: str) -> tuple[Any, Any]:
    """(data, root node) of one YAML document, within MAX_DEPTH, MAX_VALUES and
    MAX_PARSE_S, duplicate keys refused; every failure is a ConfigError."""
    deadline = clock() + MAX_PARSE_S
    try:
        try:
            return _read(_Loader, text, deadline)
        except yaml.YAMLError as e:
            problem = getattr(e, "problem", None) or str(e)
            if _Loader is _PyLoader or not _LIBYAML_NESTING.search(problem):
                raise
            raise _nesting_problem(text, e, deadline) from e
    except _DocError as e:
        line = e.mark.line + 1 if e.mark is not None else None
        raise ConfigError(source, [_problem(e.path, e.msg, line)]) from e
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        if mark is not None:
            where = f"line {mark.line + 1}, column {mark.column + 1}: "
        elif isinstance(e, yaml.reader.ReaderError):  # position: bytes (libyaml), else chars
            if _Loader is _PyLoader:
                line = text[:e.position].count("\n") + 1
            else:
                line = text.encode("utf-8", "replace")[:e.position].count(b"\n") + 1
            where = f"line {line}: "
        else:
            where = ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(source, [f"{where}invalid YAML: {problem}"]) from e
    except RecursionError as e:  # a bound above was missed; still no traceback
        raise ConfigError(source, [f"nested too deeply (limit {MAX_DEPTH})"]) from e


def _read(loader_class: type, text: str, deadline: float) -> tuple[Any, Any]:
    """read_yaml with one parser; a _DocError carries its key path."""
    loader, root = loader_class(text), None  # the pure-Python reader checks every character
    try:
        root = _compose(loader, deadline)
        return (None if root is None else loader.construct_document(root)), root
    except _DocError as e:
        if e.node is not None:
            e.path = _find(root, e.node)
        raise
    finally:
        loader.dispose()


# libyaml 0.2.6 (in PyYAML 6.0.4's wheels) refuses nesting deeper than 1,000 levels itself:
# "exceeded maximum nesting depth", no key path. Its scanner reads up to 1,024 characters
# ahead of the events gemmd composes (a flow collection may turn out to be a mapping key),
# so "[[[[..." on one line reaches that limit before _compose sees level MAX_DEPTH + 1.
_LIBYAML_NESTING = re.compile(r"nesting", re.IGNORECASE)


def _nesting_problem(text: str, e: yaml.YAMLError, deadline: float) -> _DocError:
    """gemmd's own problem for a document libyaml refused as nested too deeply: the
    pure-Python parser, which has no such limit of its own, reads it again and meets
    MAX_DEPTH (< libyaml's 1,000) first, at the same place as on any other PyYAML."""
    try:
        _read(_PyLoader, text, deadline)
    except _DocError as found:
        return found
    except yaml.YAMLError:
        pass
    # Not expected (libyaml counts the same collections); still gemmd's message, at
    # libyaml's position.
    return _DocError("", f"nested deeper than {MAX_DEPTH} levels",
                     getattr(e, "problem_mark", None))


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
