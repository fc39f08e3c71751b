"""gemmd.yaml's schema: one frozen dataclass per section, each field with its default and,
in its metadata, what validation checks (min, max, choices). The names and defaults here
are the configuration file's keys and values.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gemmd.gemm import DTYPES, KERNELS, LAYOUTS

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
    # Explore in one round of every this many (1: every round). An exploration probe costs
    # what a sentinel does (its window and ~0.1-0.2 s beyond it: ~0.7 s of an H200 at 0.5 s),
    # which every round would add to the plan's GPU time.
    every_rounds: int = _f(1, min=1, max=100_000)
    m: tuple[int, int] = _f((256, 4096), min=1, max=1 << 20)
    n: tuple[int, int] = _f((256, 4096), min=1, max=1 << 20)
    k: tuple[int, int] = _f((256, 4096), min=1, max=1 << 20)
    align: int = _f(64, min=1, max=4096)
    # This share of the draws leaves M, N, K as drawn, not rounded to `align`: cuBLAS runs
    # sizes that are not multiples of 8 on other kernels (an H200's bf16 3-4x slower), and
    # a model learns them only from such probes (docs/model.md, "Alignment").
    unaligned: float = _f(0.0, min=0.0, max=1.0)


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
    ExplorationConfig(per_round=1, every_rounds=10, m=(256, 8192), n=(256, 8192),
                      k=(256, 8192), align=64, unaligned=0.25, dtypes=("bf16", "fp16", "fp32"),
                      backends=_GPU),
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
    # At least 3: the interval is scaled on configurations out of the bag of 3 trees or
    # more (gemmd/model/intervals.py); with 1 or 2 it never was.
    n_estimators: int = _f(100, min=3, max=5000)
    max_depth: int = _f(0, min=0, max=200)  # 0 = unlimited
    min_samples_leaf: int = _f(2, min=1, max=10000)
    # Most leaves per tree (0 = unlimited): bounds a forest's memory whatever the store
    # holds, about n_estimators x 2 x this x 22 bytes per target in the daemon (the flat
    # arrays of the model file), x 112 where it is fitted (bench/RESULTS.md, "Memory over
    # a week"); trees grow best-first, the most useful splits first.
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
    comparison with same-model peers; see docs/drift.md and gemmd/drift/."""

    shift: float = _f(0.05, min=0.001, max=10.0)  # relative change to detect (0.05 = 5%)
    # Healthy results between false alarms of one CUSUM (a probe x target, or a device's
    # pooled statistic for a target), on average.
    arl0: float = _f(2e6, min=10.0, max=1e15)
    # At least 5: the start-up step check compares rounds 4 on with the first 3 and
    # alarms on two in a row (gemmd/drift/params.py BASE_FIRST, BASE_HITS); fewer left a
    # step at the baseline's edge to the later checks, or with 2 to none at start.
    baseline_probes: int = _f(10, min=5, max=10000)
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
    # Set: the slowdown holds while this file exists instead (a demo or a test starts it
    # when it chooses: `touch` it once drift is armed, remove it to end it).
    slowdown_when_file: str = _f("")
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
