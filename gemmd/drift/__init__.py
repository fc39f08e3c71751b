"""Drift detection per device: each probe's own track, the device's pooled evidence, its
slow level, one alarm per device and target that names its cause, and peers.

Full arithmetic, parameters and benchmark figures: docs/drift.md. In short:

residual  r = log(measured / predicted), per probe result and target (runtime, power,
              energy). A card's steady offset from the model is not drift: each track
              learns its own level (the reference, exported as a ratio). Where the model
              predicts no power or energy yet, the caller passes a stand-in (the power
              limit): sentinels are compared with their own history, so drift arms after
              its baseline rounds, model or not.
series    every track is a series with its own AR(1) model, fitted while in control:
              r_t - L = phi (r_{t-1} - L) + e_t. The CUSUM runs on the standardized
              innovations u = e / sigma_e (pre-whitening). A sustained shift d moves u by
              d (1 - phi) / sigma_e per result (the first by d / sigma_e).
learning  level, phi and sigma_e are learnt only while in control (no alarm, the series'
              and its device's CUSUMs low, the device's slow level within half the
              tolerance) and only from results within LEARN_Z scales of their prediction
              (a symmetric cut: unbiased; the first result of a large step is never
              learnt). The level is the mean of the values learnt over the first LEVEL_N,
              then frozen, so a slow degradation is not absorbed; the noise keeps adapting
              (memory NOISE_N). sigma_e is taken at its 99% chi-square bound, times
              (1 - phi) / (1 - phi_hi) for an autocorrelation PHI_Z standard errors above
              its estimate, times its misfit (innovations that wander together: noise an
              AR(1) does not describe) and its tail factor (heavier tails than Gaussian);
              the allowance is raised by LEVEL_Z standard errors of the level.
CUSUM     S = max(0, S + min(u', k + c h) - k), k the steady response to the allowance
              kappa = (shift + tolerance) / 2 on a probe's track (half ``shift`` without a
              tolerance): a wiggle of the tolerated amplitude drains it instead of filling
              it. h from ``arl0`` by Siegmund's approximation. Bounded influence: one result
              adds at most c h (c = 0.35 on a probe's track: three results, however far
              off, are needed from S = 0; 0.49 on the pooled statistic: three rounds).
device    per device and target, once per round: the pooled statistic
              Z = sum_i g_i u_i / sqrt(sum_i g_i^2), a series of its own with a CUSUM (the
              fast detector, for shifts of ``shift``), judged against the device's band (a
              fast EWMA of its rounds, used within +-``tolerance``: a slow wiggle such as a
              daily cycle is followed, not allowed for) with half the shift as allowance,
              once it has learnt DEVICE_YOUNG_N results (before: as a probe's track); the
              round's deviation y (log units:
              the probes' deviations from their references, weighted by their noise, each
              clipped to 3 scales around their median) and its slow level m, an EWMA with a
              half-life of SLOW_HALF rounds: beyond ``tolerance`` at SLOW_Z standard errors
              it is an alarm (a small shift, a ramp); below -tolerance it is a speed-up,
              reported and, after SPEEDUP_ROUNDS rounds, taken as the new normal.
alarm     a device and target is in alarm from the first trigger (its pooled CUSUM, a
              probe's own CUSUM, its slow level, or during the baseline two rounds far
              above the first three) until it has been quiet (no CUSUM in alarm, no round
              beyond the allowance, its level within tolerance) for QUIET_MIN rounds, or
              QUIET_GAPS times the longest quiet spell seen during the alarm: an
              intermittent fault keeps one alarm, whose reason becomes "intermittent".
              Its cause comes from the probes' context (clocks, clock-event reasons, power
              limit, temperature) against the context of the reference period.
peers     a card slow from its first result is its own reference, so its CUSUMs never
              see it. Each device's levels are compared with those of the other devices
              of the same model on the host, probe by probe (median of the siblings),
              pooled by precision: slower than peers when the lower PEER_Z-sigma bound of
              the pooled ratio exceeds 1 + ``peer_margin`` (cleared when the ratio itself
              is back within it).

State is saved to a JSON file so a restart does not take a degraded card as its new
baseline (version 3; versions 1 and 2 still load). The arithmetic is written on numpy
arrays (``start``, ``step``, ``pool``, ``pooled_deviation``, ``device_step``,
``baseline_check``), so that bench/drift.py simulates thousands of GPUs with the code the
daemon runs.
"""

from gemmd.drift.causes import CAUSES
from gemmd.drift.monitor import DriftMonitor
from gemmd.drift.residuals import measured_of, predicted_of, residual_of, stand_in
from gemmd.drift.tracks import Alarm, DeviceDrift, Track, Transition

__all__ = ["CAUSES", "Alarm", "DeviceDrift", "DriftMonitor", "Track", "Transition",
           "measured_of", "predicted_of", "residual_of", "stand_in"]
