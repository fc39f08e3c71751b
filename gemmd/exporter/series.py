"""What gemmd's series are called and labelled: the label sets, the reasons exported from
the start, the two profiles and the hostname and build labels.

Probe series carry the device labels and ``probe`` only: the probe's name encodes its
configuration, which ``gemmd_probe_info`` spells out as labels once per probe (join with
``* on(instance, probe) group_left(dtype, ...) gemmd_probe_info``). Label sets that exist
for alerting (skip reasons, clock-event reasons, outcomes) are exported in full from the
start, at 0: a series that only appears when something happens cannot be alerted on.

Two profiles (``metrics.profile``): ``lean``, the default, exports what the shipped alert
rules, recording rules and dashboards read (``LEAN``; about 50 series per GPU with the
default plan of two sentinel probes); ``full`` adds the drift detector's internals, the
probes' measurement details, the power and energy prediction intervals and the
per-reason clock events (about 150 per GPU), for debugging. ``assemble()`` defaults to
``full`` (the tests and the benches read everything); the daemon passes its setting.
With ``hostname``, every series carries a ``hostname`` label (the host as operators name
it: Kubernetes' node, dcgm-exporter's ``Hostname``).
"""

from __future__ import annotations

import functools
import json
import os
import socket
from collections.abc import Iterable, Iterator
from importlib import metadata
from pathlib import Path

from prometheus_client.core import Metric

from gemmd.gemm import COLUMN, TARGETS, UNIT
from gemmd.records import CLOCK_EVENT_REASONS
from gemmd.state import DeviceState

DEVICE_LABELS = ("gpu", "uuid", "gpu_model")
# What gemmd_device_info adds to the device labels: the backend, and the DeviceInfo.extra
# keys of the same names where the backend fills them ("" otherwise).
INFO_LABELS = ("backend", "driver_version", "cuda_driver_version", "pci_bus_id",
               "vbios_version")
# The probe series carry the device labels and `probe`; gemmd_probe_info has the rest.
PROBE_SERIES_LABELS = (*DEVICE_LABELS, "probe")
OUTCOMES = ("ok", "failed", "mismatch")
KINDS = ("sentinel", "exploration")
# Every reason a round or probe is skipped for (gemmd/rounds.py and the backends'
# busy_reason()), exported from the start at 0 so that rate() and alerts see them: the
# rounds' own, and the busy reasons the device's backend can give.
ROUND_SKIPS = ("device_down", "duty_cycle", "unsupported")  # rounds.py
BUSY_REASONS = {"nvidia": ("other_processes", "utilization", "other_memory"),
                "fake": ("other_processes", "utilization", "other_memory"),
                "cpu": ("host_busy",)}
SKIP_REASONS = (*ROUND_SKIPS, "other_processes", "utilization", "other_memory", "host_busy")
# Every known clock-event reason, 0 or 1 on every device (CPU and fake ones included).
CLOCK_EVENTS = tuple(CLOCK_EVENT_REASONS.values())
_CLOCK_EVENT_BITS = {name: bit for bit, name in CLOCK_EVENT_REASONS.items()}

PROFILES = ("lean", "full")
# The lean profile: every family the shipped rules (deploy/prometheus/gemmd.rules.yml) and
# dashboards (grafana/dashboards) read, the host-level ones, and the probe series the
# operator looks at (measured, predicted, the runtime interval, each probe's normal). What
# only `full` has: the drift detector's internals (CUSUMs, thresholds, z-scores, scales,
# per-probe alarms, armed/level/faster, alarm counters), the probes' measurement details
# (ratio = measured / predicted, FLOP/s, CV, iterations, window, age, domain), the power and
# energy prediction intervals, per-reason clock events (lean: the bitmask), static device
# facts (SMs, memory, plan size). tests/test_rules.py checks that the rules read only these.
LEAN = frozenset({
    "gemmd_build_info", "gemmd_start_time_seconds", "gemmd_store_errors", "gemmd_clock_jumps",
    "gemmd_probe_interval_seconds",
    "gemmd_device_info", "gemmd_device_up", "gemmd_device_consecutive_failures",
    "gemmd_probes", "gemmd_probes_skipped", "gemmd_device_rounds", "gemmd_device_probe_seconds",
    "gemmd_device_last_round_timestamp_seconds", "gemmd_device_sm_clock_hertz",
    "gemmd_device_memory_clock_hertz", "gemmd_device_temperature_celsius",
    "gemmd_device_power_limit_watts", "gemmd_device_clock_event_reasons",
    "gemmd_probe_info",
    *(f"gemmd_probe_{t}_{u}" for t, u in UNIT.items()),
    *(f"gemmd_probe_{t}_predicted_{u}" for t, u in UNIT.items()),
    "gemmd_probe_runtime_predicted_lower_seconds", "gemmd_probe_runtime_predicted_upper_seconds",
    "gemmd_probe_drift_reference_ratio",
    "gemmd_device_drifting", "gemmd_device_drift_ratio", "gemmd_device_drift_cause",
    "gemmd_device_peer_ratio", "gemmd_device_slower_than_peers",
    "gemmd_drift_peer_margin_ratio", "gemmd_drift_tolerance_ratio",
    "gemmd_model_info", "gemmd_model_training_samples", "gemmd_model_fit_timestamp_seconds",
    "gemmd_model_validation_error_ratio", "gemmd_model_refits",
    "gemmd_model_last_refit_timestamp_seconds",
    "gemmd_device_probe_in_flight_seconds", "gemmd_scrape_collector_success",
    "gemmd_scrape_duration_seconds",
})
# Families the lean profile keeps for some label values only: the peer comparison that
# the rules read is the runtime's.
LEAN_LABELS = {"gemmd_device_peer_ratio": ("target", "runtime")}


def host_name(setting: str = "auto") -> str:
    """The `hostname` label: ``setting`` unless "auto" (or empty): then $NODE_NAME (set
    from the pod's spec.nodeName on Kubernetes, as dcgm-exporter reads it), else the host's
    name."""
    if setting and setting != "auto":
        return setting
    return os.environ.get("NODE_NAME", "").strip() or socket.gethostname()


@functools.cache
def build_revision() -> str:
    """The source revision gemmd was built from: $GEMMD_REVISION (an image build sets it),
    else the commit a pip install from git recorded, else the commit of the git checkout
    the package is imported from (read from .git, no git command), else "unknown"."""
    rev = os.environ.get("GEMMD_REVISION", "").strip()
    if rev:
        return rev
    try:
        direct = metadata.distribution("gemmd-gpu").read_text("direct_url.json")
        commit = json.loads(direct or "{}").get("vcs_info", {}).get("commit_id")
        if commit:
            return str(commit)[:12]
    except (metadata.PackageNotFoundError, ValueError, OSError, AttributeError):
        pass
    try:
        return _git_head(Path(__file__).resolve().parents[2] / ".git") or "unknown"
    except (OSError, ValueError, UnicodeDecodeError):
        return "unknown"


def _git_head(git: Path) -> str | None:
    if git.is_file():  # a worktree: "gitdir: PATH"
        text = git.read_text().strip()
        if not text.startswith("gitdir:"):
            return None
        git = (git.parent / text.split(":", 1)[1].strip()).resolve()
    head = (git / "HEAD").read_text().strip()
    if not head.startswith("ref:"):
        return head[:12] or None
    ref = head.split(":", 1)[1].strip()
    for base in (git, git / "commondir"):
        if base.name == "commondir":  # a worktree's refs live in the main repository
            if not base.is_file():
                continue
            base = (git / base.read_text().strip()).resolve()
        loose = base / ref
        if loose.is_file():
            return loose.read_text().strip()[:12]
        packed = base / "packed-refs"
        if packed.is_file():
            for line in packed.read_text().splitlines():
                if line.endswith(" " + ref):
                    return line.split()[0][:12]
    return None


def clock_event_mask(reasons: Iterable[str]) -> int:
    """NVML's clock-event bitmask (as DCGM_FI_DEV_CLOCKS_EVENT_REASONS) of reason names,
    unknown bits (``unknown_0x...``) included."""
    mask = 0
    for r in reasons:
        r = str(r)
        if r in _CLOCK_EVENT_BITS:
            mask |= _CLOCK_EVENT_BITS[r]
        elif r.startswith("unknown_"):
            try:
                mask |= int(r.removeprefix("unknown_"), 16)
            except ValueError:
                pass
    return mask


def shaped(families: Iterable[Metric], profile: str = "full",
           hostname: str | None = None) -> Iterator[Metric]:
    """The families of a profile (lean: ``LEAN``, ``LEAN_LABELS``), each sample with the
    ``hostname`` label when one is given."""
    for fam in families:
        if profile == "lean":
            if fam.name not in LEAN:
                continue
            keep = LEAN_LABELS.get(fam.name)
            if keep is not None:
                fam.samples = [s for s in fam.samples if s.labels.get(keep[0]) == keep[1]]
        if hostname is not None:
            fam.samples = [s._replace(labels={**s.labels, "hostname": hostname})
                           for s in fam.samples]
        yield fam


_TARGETS = tuple((t, UNIT[t], COLUMN[t], noun) for t, noun in zip(TARGETS, (
    "median per-GEMM runtime", "average power over the probe window", "energy per GEMM")))


def _dev_labels(d: DeviceState) -> list[str]:
    return [str(d.info.index), d.info.uuid, d.info.name]


def _info_labels(d: DeviceState) -> list[str]:
    extra = d.info.extra or {}
    return [d.info.backend, *(str(extra.get(k) or "") for k in INFO_LABELS[1:])]
