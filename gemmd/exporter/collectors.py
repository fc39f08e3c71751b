"""Prometheus collectors, one per metric group, over the daemon's live state.

Collectors read only the in-memory state (one snapshot per state change, shared by the
groups): no device, NVML or store call runs on a scrape. Measured and predicted values
share identical label sets so that PromQL can divide them directly; label values come from
the probe plan, never from unbounded data. The label sets and profiles are series.py's;
assembly.py puts the groups together.
"""

from __future__ import annotations

import logging
import math
import platform
import threading
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gemmd import __version__
from gemmd.drift import CAUSES
from gemmd.exporter.series import (
    _TARGETS,
    BUSY_REASONS,
    CLOCK_EVENTS,
    DEVICE_LABELS,
    INFO_LABELS,
    KINDS,
    OUTCOMES,
    PROBE_SERIES_LABELS,
    ROUND_SKIPS,
    SKIP_REASONS,
    _dev_labels,
    _info_labels,
    build_revision,
    clock_event_mask,
    shaped,
)
from gemmd.gemm import PROBE_LABELS, TARGETS
from gemmd.state import DeviceState, Snapshot, State

logger = logging.getLogger(__name__)


class Snapshots:
    """One copy of the state per state change, shared by the groups of a render; and
    whether every group rendered the last time (gemmd_scrape_collector_success)."""

    def __init__(self, state: State):
        self.state = state
        self._lock = threading.Lock()
        self._version: int | None = None
        self._snap: Snapshot | None = None
        self.failed: set[str] = set()

    def get(self) -> Snapshot:
        with self._lock:
            version = self.state.version
            if version != self._version or self._snap is None:
                self._snap, self._version = self.state.snapshot(), version
            return self._snap


class _Group(Collector):
    """A collector of one metric group; a bug in one group never fails a scrape."""

    name = ""

    def __init__(self, snapshots: Snapshots, profile: str = "full",
                 hostname: str | None = None):
        self.snapshots = snapshots
        self.profile = profile
        self.hostname = hostname

    def collect(self) -> Iterator[Metric]:
        try:
            families = list(shaped(self.families(self.snapshots.get()), self.profile,
                                   self.hostname))
        except Exception:
            logger.exception("collecting the %s metrics failed", self.name)
            self.snapshots.failed.add(self.name)
            return
        self.snapshots.failed.discard(self.name)
        yield from families

    def families(self, snap: Snapshot) -> Iterator[Metric]:
        raise NotImplementedError


class DaemonCollector(_Group):
    """Build, start time, store errors, the probe interval."""

    name = "daemon"

    def families(self, snap: Snapshot) -> Iterator[Metric]:
        info = GaugeMetricFamily("gemmd_build_info", "gemmd build information: version, "
                                 "source revision, Python version", labels=(
                                     "version", "revision", "python_version"))
        info.add_metric([__version__, build_revision(), platform.python_version()], 1)
        yield info
        yield GaugeMetricFamily("gemmd_start_time_seconds",
                                "Unix time the daemon started", value=self.snapshots.state.started)
        yield CounterMetricFamily("gemmd_store_errors", "Probe results that could not be "
                                  "written to the store", value=snap.store_errors_total)
        yield CounterMetricFamily("gemmd_clock_jumps", "Jumps of the wall clock against the "
                                  "monotonic clock the daemon saw (its jobs were re-armed)",
                                  value=self.snapshots.state.clock_jumps_total)
        if snap.probe_interval_s:
            yield GaugeMetricFamily("gemmd_probe_interval_seconds",
                                    "Configured time between probe rounds of a device",
                                    value=snap.probe_interval_s)


class DeviceCollector(_Group):
    """Per device: info, up, failures, plan, probes and skips, rounds, clocks, reasons."""

    name = "devices"

    def families(self, snap: Snapshot) -> Iterator[Metric]:
        return self._devices(snap.devices)

    def _devices(self, devices: list[DeviceState]) -> Iterator[Metric]:
        L = DEVICE_LABELS
        dinfo = GaugeMetricFamily("gemmd_device_info", "Probed device: backend, driver, "
                                  "CUDA driver, PCI bus id and VBIOS (value is always 1)",
                                  labels=(*L, *INFO_LABELS))
        sms = GaugeMetricFamily("gemmd_device_streaming_multiprocessors",
                                "Streaming multiprocessors of the device (GPUs only)", labels=L)
        mem = GaugeMetricFamily("gemmd_device_memory_bytes",
                                "Total memory of the device (GPUs only)", labels=L)
        up = GaugeMetricFamily("gemmd_device_up",
                               "1 if the device is probing normally, 0 if marked down", labels=L)
        fails = GaugeMetricFamily("gemmd_device_consecutive_failures",
                                  "Failed probe rounds in a row (reset by a good round)", labels=L)
        plan = GaugeMetricFamily("gemmd_device_plan_probes",
                                 "Sentinel probes in this device's plan", labels=L)
        probes = CounterMetricFamily("gemmd_probes", "Probes run, by kind and outcome",
                                     labels=(*L, "kind", "outcome"))
        skipped = CounterMetricFamily("gemmd_probes_skipped", "Probes not run, by reason",
                                      labels=(*L, "reason"))
        rounds = CounterMetricFamily("gemmd_device_rounds", "Probe rounds started", labels=L)
        probing = CounterMetricFamily("gemmd_device_probe_seconds",
                                   "Device time spent running probes (rate() = duty cycle)",
                                   labels=L)
        last = GaugeMetricFamily("gemmd_device_last_round_timestamp_seconds",
                                 "Unix time the last probe round ended", labels=L)
        ctx_fams = {
            "sm_clock_hz": GaugeMetricFamily("gemmd_device_sm_clock_hertz",
                                             "SM clock after the latest probe", labels=L),
            "mem_clock_hz": GaugeMetricFamily("gemmd_device_memory_clock_hertz",
                                              "Memory clock after the latest probe", labels=L),
            "temperature_c": GaugeMetricFamily("gemmd_device_temperature_celsius",
                                               "Temperature after the latest probe", labels=L),
            "power_limit_w": GaugeMetricFamily("gemmd_device_power_limit_watts",
                                               "Enforced power limit", labels=L),
        }
        reasons = GaugeMetricFamily("gemmd_device_clock_event_active",
                                    "Clock-event (throttle) reasons active after the latest "
                                    "probe (1 = active)", labels=(*L, "reason"))
        mask = GaugeMetricFamily("gemmd_device_clock_event_reasons",
                                 "Clock-event (throttle) reasons active after the latest "
                                 "probe, as NVML's bitmask (as dcgm-exporter's "
                                 "DCGM_FI_DEV_CLOCKS_EVENT_REASONS: 0x4 sw_power_cap, 0x8 "
                                 "hw_slowdown, 0x20 sw_thermal_slowdown, 0x40 "
                                 "hw_thermal_slowdown, 0x80 hw_power_brake_slowdown, ...)",
                                 labels=L)
        for d in devices:
            lv = _dev_labels(d)
            dinfo.add_metric([*lv, *_info_labels(d)], 1)
            if d.info.sm_count:
                sms.add_metric(lv, d.info.sm_count)
            if d.info.memory_bytes:
                mem.add_metric(lv, d.info.memory_bytes)
            up.add_metric(lv, 1.0 if d.up else 0.0)
            fails.add_metric(lv, d.consecutive_failures)
            plan.add_metric(lv, d.plan_size)
            for kind in KINDS:
                for outcome in OUTCOMES:
                    probes.add_metric([*lv, kind, outcome], d.probes_total[(kind, outcome)])
            busy = BUSY_REASONS.get(d.info.backend, SKIP_REASONS[len(ROUND_SKIPS):])
            for reason in sorted({*ROUND_SKIPS, *busy} | set(d.skipped_total)):
                skipped.add_metric([*lv, reason], d.skipped_total[reason])
            rounds.add_metric(lv, d.rounds_total)
            probing.add_metric(lv, d.probe_seconds_total)
            if d.last_round_ts:
                last.add_metric(lv, d.last_round_ts)
            for key, fam in ctx_fams.items():
                v = d.context.get(key)
                if key == "power_limit_w" and v is None:
                    v = d.info.power_limit_w
                if isinstance(v, (int, float)):
                    fam.add_metric(lv, float(v))
            active = {str(r) for r in d.context.get("clock_event_reasons", [])}
            for r in sorted(set(CLOCK_EVENTS) | active):  # unknown bits (unknown_0x...) too
                reasons.add_metric([*lv, r], 1.0 if r in active else 0.0)
            mask.add_metric(lv, float(clock_event_mask(active)))
        yield from (dinfo, sms, mem, up, fails, plan, probes, skipped, rounds, probing, last,
                    *ctx_fams.values(), reasons, mask)

class ProbeCollector(_Group):
    """Per device and sentinel probe: measured, predicted, interval, ratio, window; and
    once per probe its configuration (gemmd_probe_info)."""

    name = "probes"

    def families(self, snap: Snapshot) -> Iterator[Metric]:
        return self._probes(snap.devices, snap.probes, snap.drift)

    def _probes(self, devices: list[DeviceState], probes: list, drift: dict
                ) -> Iterator[Metric]:
        by_uuid = {d.info.uuid: d for d in devices}
        labels = PROBE_SERIES_LABELS
        info = GaugeMetricFamily("gemmd_probe_info", "A probe's configuration, which its "
                                 "name encodes (value is always 1)", labels=PROBE_LABELS)
        specs = {ps.spec for uuid, ps in probes if uuid in by_uuid}
        specs |= {spec for (uuid, spec, _) in drift if uuid in by_uuid}
        for spec in sorted(specs):
            info.add_metric([spec.labels()[k] for k in PROBE_LABELS], 1)
        yield info
        fams: dict[str, GaugeMetricFamily] = {}

        def fam(name: str, doc: str) -> GaugeMetricFamily:
            if name not in fams:
                fams[name] = GaugeMetricFamily(name, doc, labels=labels)
            return fams[name]

        for uuid, ps in sorted(probes, key=lambda x: (x[0], x[1].spec)):
            d = by_uuid.get(uuid)
            if d is None:
                continue
            lv = [*_dev_labels(d), ps.spec.name]
            m, p = ps.measurement, ps.prediction
            for name, unit, attr, noun in _TARGETS:
                measured, predicted = getattr(m, attr), getattr(p, attr)
                if measured is not None:
                    fam(f"gemmd_probe_{name}_{unit}", f"Measured {noun}").add_metric(lv, measured)
                if predicted is not None:
                    fam(f"gemmd_probe_{name}_predicted_{unit}",
                        f"Predicted {noun}").add_metric(lv, predicted)
                    fam(f"gemmd_probe_{name}_predicted_lower_{unit}",
                        f"Lower bound of the prediction interval of {noun}").add_metric(
                            lv, getattr(p, f"{name}_lo"))
                    fam(f"gemmd_probe_{name}_predicted_upper_{unit}",
                        f"Upper bound of the prediction interval of {noun}").add_metric(
                            lv, getattr(p, f"{name}_hi"))
                if measured is not None and predicted:
                    fam(f"gemmd_probe_{name}_ratio",
                        f"Measured / predicted {noun}").add_metric(lv, measured / predicted)
            fam("gemmd_probe_flops_per_second", "Achieved FLOP/s (2MNK / median runtime)"
                ).add_metric(lv, m.spec.flops / m.runtime_s)
            fam("gemmd_probe_runtime_variation_ratio",
                "Coefficient of variation of per-iteration runtimes in the window"
                ).add_metric(lv, m.runtime_cv)
            fam("gemmd_probe_iterations", "GEMMs in the last timed window").add_metric(
                lv, m.iterations)
            fam("gemmd_probe_window_seconds", "Length of the last timed window").add_metric(
                lv, m.window_s)
            fam("gemmd_probe_last_timestamp_seconds", "Unix time of the last measurement"
                ).add_metric(lv, ps.ts)
            fam("gemmd_probe_prediction_in_domain",
                "1 if the prediction comes from inside the model's training domain (GPU "
                "model measured as the daemon measures, dtype/kernel, size range), 0 if the "
                "model is extrapolating or has no data yet (gemmd predict --source daemon "
                "says why)").add_metric(
                    lv, 1.0 if getattr(p, "in_domain", True) else 0.0)
        yield from fams.values()

class DriftCollector(_Group):
    """Per probe and target: CUSUM, threshold, z, reference, scale, alarm. Per device and
    target: the pooled statistic (what pages), the alarm (pooled or any probe's), the
    standing among same-model peers."""

    name = "drift"

    def families(self, snap: Snapshot) -> Iterator[Metric]:
        return self._drift(snap.devices, snap)

    def _drift(self, devices: list[DeviceState], snap: Snapshot) -> Iterator[Metric]:
        by_uuid = {d.info.uuid: d for d in devices}
        labels = (*PROBE_SERIES_LABELS, "target")
        cusum = GaugeMetricFamily(
            "gemmd_probe_drift_cusum", "CUSUM of standardized residual innovations (alarm "
            "above gemmd_probe_drift_threshold)", labels=labels)
        thr = GaugeMetricFamily(
            "gemmd_probe_drift_threshold", "CUSUM alarm threshold of this track, set by its "
            "noise and drift.arl0", labels=labels)
        z = GaugeMetricFamily("gemmd_probe_drift_zscore",
                              "Latest residual innovation, in its noise scales",
                              labels=labels)
        ref = GaugeMetricFamily(
            "gemmd_probe_drift_reference_ratio", "Measured/predicted ratio taken as normal "
            "for this device and probe (its learnt level)", labels=labels)
        scale = GaugeMetricFamily("gemmd_probe_drift_scale",
                                  "Long-run residual scale (log units): the probe's noise, "
                                  "autocorrelation counted, at its upper bound, at least "
                                  "drift.min_scale", labels=labels)
        drifting = GaugeMetricFamily("gemmd_probe_drifting",
                                     "1 while this probe's own track is in drift alarm",
                                     labels=labels)
        alarms: dict[tuple, int] = {}
        probe_drift: dict[tuple[str, str], bool] = {}
        for (uuid, spec, target), tr in sorted(snap.drift.items(),
                                               key=lambda x: (x[0][0], x[0][1], x[0][2])):
            d = by_uuid.get(uuid)
            if d is None:
                continue
            dl = _dev_labels(d)
            alarms[(*dl, target)] = alarms.get((*dl, target), 0) + tr.alarms
            if not tr.ready() or tr.reference is None:
                continue
            lv = [*dl, spec.name, target]
            cusum.add_metric(lv, tr.cusum)
            if tr.h is not None:
                thr.add_metric(lv, tr.h)
            if tr.last_z is not None:
                z.add_metric(lv, tr.last_z)
            ref.add_metric(lv, math.exp(tr.reference))
            scale.add_metric(lv, tr.scale or 0.0)
            drifting.add_metric(lv, 1.0 if tr.drifting else 0.0)
            key = (uuid, target)
            probe_drift[key] = probe_drift.get(key, False) or tr.drifting
        yield from (cusum, thr, z, ref, scale, drifting)
        total = CounterMetricFamily("gemmd_drift_alarms", "Drift alarms raised by the "
                                    "device's probes' own tracks",
                                    labels=(*DEVICE_LABELS, "target"))
        for d in devices:
            for target in TARGETS:
                dev_target = (*_dev_labels(d), target)
                total.add_metric(list(dev_target), alarms.get(dev_target, 0))
        yield total
        yield from self._devices(devices, snap, probe_drift)

    def _devices(self, devices: list[DeviceState], snap: Snapshot,
                 probe_drift: dict[tuple[str, str], bool]) -> Iterator[Metric]:
        L = (*DEVICE_LABELS, "target")
        fams = {
            "drifting": GaugeMetricFamily(
                "gemmd_device_drifting", "1 while the device is in drift alarm for this "
                "target: its pooled statistic or any of its probes' own tracks (its results "
                "are then kept out of refits)", labels=L),
            "cusum": GaugeMetricFamily(
                "gemmd_device_drift_cusum", "CUSUM of the device's pooled statistic (its "
                "probes' evidence together; alarm above gemmd_device_drift_threshold)",
                labels=L),
            "h": GaugeMetricFamily("gemmd_device_drift_threshold",
                                   "Alarm threshold of the device's pooled CUSUM", labels=L),
            "z": GaugeMetricFamily("gemmd_device_drift_zscore",
                                   "Latest round's pooled statistic, innovation in its "
                                   "noise scales", labels=L),
            "ratio": GaugeMetricFamily(
                "gemmd_device_drift_ratio", "Latest round's measured/normal ratio of the "
                "device, pooled over its probes (weighted by their noise)", labels=L),
            "scale": GaugeMetricFamily(
                "gemmd_device_drift_scale", "Long-run scale of the pooled statistic: 1 when "
                "the probes' noise is independent, up to sqrt(probes) when it moves "
                "together (pooling then gains nothing)", labels=L),
            "members": GaugeMetricFamily("gemmd_device_drift_probes",
                                         "Probes pooled in the latest round", labels=L),
            "armed": GaugeMetricFamily(
                "gemmd_device_drift_armed", "1 once the device's drift statistics for this "
                "target have their baseline (a few rounds after start or a rebaseline, model "
                "or not); 0 while it is taken (only a large step is caught then)", labels=L),
            "level": GaugeMetricFamily(
                "gemmd_device_drift_level_ratio", "The device's slow level: its rounds' "
                "measured/normal, smoothed over about an hour (alarm when confidently beyond "
                "1 + drift.tolerance)", labels=L),
            "faster": GaugeMetricFamily(
                "gemmd_device_drift_faster", "1 while the device is confidently faster (less "
                "power, fewer joules) than its normal by more than drift.tolerance; held "
                "for an hour, the new behaviour becomes its normal", labels=L),
            "peer": GaugeMetricFamily(
                "gemmd_device_peer_ratio", "The device's normal (its learnt reference) "
                "against the median of the other devices of the same model on the host, "
                "pooled over probes (1.05: 5 % slower, more watts, more joules)", labels=L),
        }
        alarms = CounterMetricFamily("gemmd_device_drift_alarms",
                                     "Drift alarms raised for the device (by its pooled "
                                     "statistic, its slow level or a probe's own track)",
                                     labels=L)
        speedups = CounterMetricFamily("gemmd_device_drift_speedups", "Speed-ups taken as "
                                       "the device's new normal", labels=L)
        cause = GaugeMetricFamily(
            "gemmd_device_drift_cause", "1 while the device is in drift alarm for this target, "
            "labelled with why (reason: step, gradual, probe, intermittent) and what changed "
            "with it (cause, from the probes' clocks, clock-event reasons, power limit and "
            "temperature; description: the cause in words)",
            labels=(*L, "reason", "cause", "description"))
        slower = GaugeMetricFamily(
            "gemmd_device_slower_than_peers", "1 while the device's normal runtime is "
            "slower than its same-model peers' on the host by more than drift.peer_margin "
            "(at 3 standard errors)", labels=DEVICE_LABELS)
        cfg = snap.drift_config
        targets = cfg.targets if cfg is not None else TARGETS
        for d in devices:
            dl = _dev_labels(d)
            dd = snap.drift_devices.get(d.info.uuid)
            for target in targets:
                lv = [*dl, target]
                tr = dd.targets.get(target) if dd is not None else None
                pooled = tr is not None and tr.drifting
                fams["drifting"].add_metric(lv, 1.0 if pooled or probe_drift.get(
                    (d.info.uuid, target), False) else 0.0)
                alarms.add_metric(lv, tr.alarms if tr is not None else 0)
                speedups.add_metric(lv, tr.speedups if tr is not None else 0)
                fams["armed"].add_metric(lv, 1.0 if tr is not None and tr.ready() else 0.0)
                if tr is None:
                    continue
                if tr.drifting:
                    code = tr.cause or "unknown"
                    cause.add_metric([*lv, tr.reason or "step", code,
                                      CAUSES.get(code, code)], 1.0)
                if tr.peer_ratio is not None:
                    fams["peer"].add_metric(lv, tr.peer_ratio)
                if not tr.ready():
                    continue
                fams["cusum"].add_metric(lv, tr.cusum)
                for key, v in (("h", tr.h), ("z", tr.last_z), ("ratio", tr.ratio),
                               ("scale", tr.scale)):
                    if v is not None:
                        fams[key].add_metric(lv, v)
                fams["members"].add_metric(lv, tr.members)
                fams["level"].add_metric(lv, math.exp(tr.level))
                fams["faster"].add_metric(lv, 1.0 if tr.faster > 0 else 0.0)
            rt = dd.targets.get("runtime") if dd is not None else None
            slower.add_metric(dl, 1.0 if rt is not None and rt.slower else 0.0)
        yield from fams.values()
        yield alarms
        yield speedups
        yield cause
        yield slower
        if cfg is not None:
            yield GaugeMetricFamily(
                "gemmd_drift_peer_margin_ratio", "drift.peer_margin: how much slower than "
                "its peers a device may be before it is flagged (0.03 = 3 %)",
                value=cfg.peer_margin)
            yield GaugeMetricFamily(
                "gemmd_drift_tolerance_ratio", "drift.tolerance: slow wiggles below this "
                "(0.02 = 2 %) are no fault; a change that holds beyond it is",
                value=cfg.tolerance)


class ModelCollector(_Group):
    """The model predictions come from: version, samples, validation error, refits."""

    name = "model"

    def families(self, snap: Snapshot) -> Iterator[Metric]:
        return self._model(snap.model)

    def _model(self, model) -> Iterator[Metric]:
        info = GaugeMetricFamily("gemmd_model_info", "The model predictions come from",
                                 labels=("version", "kind"))
        info.add_metric([model.version, model.kind], 1)
        yield info
        yield GaugeMetricFamily("gemmd_model_training_samples",
                                "Probe results the current model was fitted on",
                                value=model.n_samples)
        if model.created:
            yield GaugeMetricFamily("gemmd_model_fit_timestamp_seconds",
                                    "Unix time the current model was fitted", value=model.created)
        err = GaugeMetricFamily("gemmd_model_validation_error_ratio",
                                "Out-of-bag error of the current model per target "
                                "(mape: mean absolute percentage error as a ratio)",
                                labels=("target", "statistic"))
        for target, scores in sorted(model.scores.items()):
            for stat, v in sorted(scores.items()):
                err.add_metric([target, stat.removeprefix("oob_")], v)
        yield err
        refits = CounterMetricFamily("gemmd_model_refits", "Refit attempts by outcome",
                                     labels=("outcome",))
        for outcome in sorted({"accepted", "rejected", "insufficient_data", "failed"}
                              | set(model.refits_total)):
            refits.add_metric([outcome], model.refits_total[outcome])
        yield refits
        if model.last_refit_ts:
            yield GaugeMetricFamily("gemmd_model_last_refit_timestamp_seconds",
                                    "Unix time of the last refit attempt",
                                    value=model.last_refit_ts)

