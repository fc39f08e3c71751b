"""Drift's parameters: the constants that tune a probe's track, a device's pooled
statistic, its slow level and its alarm (docs/drift.md), and the reasons an alarm gives."""

from __future__ import annotations

RHO_MAX = 0.95  # largest lag-1 autocorrelation believed
Z_CAP = 4.0  # a probe's standardized innovation counts at most this much in the pool
CLEAN = 4.0  # innovations are winsorized at this many (safe) scales in the AR(1) filter
LEARN_Z = 4.0  # a probe's track learns only results within this many scales
DEVICE_LEARN_Z = 3.0  # a pooled statistic learns only results within this many scales

NOISE_N = 720  # the noise estimate: cumulative over this many results, then EWMA 1/N
LEVEL_N = 720  # the level is refined over this many in-control results, then frozen
LEVEL_Z = 2.33  # allowance raised by this many standard errors of the level estimate
# Results are learnt (noise) while the series' CUSUM is at most min(LEARN_BELOW h,
# LEARN_ABS), its level only while the CUSUM is at 0.
LEARN_BELOW = 0.5
LEARN_ABS = 0.5
PHI_Z = 2.33  # widen for an autocorrelation this many standard errors above its estimate
# The same for a device's pooled series: PHI_Z while it is young (fewer than DEVICE_YOUNG_N
# results learnt: its probes' autocorrelation is still uncertain, and so is its own), then
# DEVICE_PHI_Z (white when its probes' are; its misfit widens it where they are not).
DEVICE_PHI_Z = 0.0
DEVICE_YOUNG_N = 500
PEER_Z = 3.0  # slower than peers: the ratio's lower PEER_Z-sigma bound above the margin
PEER_MIN_RESULTS = 5  # results behind a level before it is compared with peers
EU_N = 16  # the innovations' EWMA: rounds it averages (the horizon misfit is measured at)
MISFIT_MAX = 4.0  # the scale is widened at most this much for innovations that wander
CAP_PROBE = 0.35  # one result adds at most this share of h to a probe's CUSUM (three)
CAP_POOLED = 0.49  # ... and one round to the device's pooled CUSUM (three rounds)
# The settled pooled CUSUM's allowance, as a share of log(1 + shift) (0.5: half way between
# 0 and the shift), judged against the device's band (BAND_HALF below).
FAST_K = 0.5
# The pooled CUSUM, and every long-run scale, widen for misfit beyond this many standard
# errors of it (a probe's own CUSUM for all of it).
MISFIT_Z = 1.0
# Heavy tails: a CUSUM's scale is widened until its innovations fall beyond TAIL_Z, on the
# side where they do more often, as often as Gaussian ones would (the share's lower bound
# at TAIL_SE standard errors), at most TAIL_MAX times; the upper side only from TAIL_HI_N
# in-control results (two hours: a slowdown's first result is one of them).
TAIL_Z = 2.5
TAIL_SE = 1.0
TAIL_MAX = 2.0
TAIL_HI_N = 60
# Once settled, the pooled statistic's noise at this normal quantile's bound (90%; 99%
# while young), its allowance raised by this many errors of its level (LEVEL_Z while young).
DEVICE_CHI_Z = 1.2816
DEVICE_LEVEL_Z = 1.0

# A rebaseline takes a new level, not new noise: each series keeps its noise model (once
# learnt from REBASE_MIN results) as if learnt from at most REBASE_N (four hours: its
# bounds stay young-ish and it adapts sooner to noise a driver update changed; a new
# baseline scattering beyond the kept model's 99% bound discards it). Before, a GPU was
# as blind after a rebaseline as a new one: at 2% noise a 5% step 30 rounds after it
# was caught within a day on 35% of GPUs (now 80%), at 1% 10 rounds after on 40% (90%).
REBASE_MIN = 30
REBASE_N = 120

SLOW_HALF = 30  # rounds: half-life of a device's slow level (an hour at 120 s)
ALPHA = 1.0 - 0.5 ** (1.0 / SLOW_HALF)
BAND_HALF = 15  # rounds: half-life of the band the pooled CUSUM is judged against
ALPHA_BAND = 1.0 - 0.5 ** (1.0 / BAND_HALF)
SLOW_Z = 3.0  # the slow level is beyond the tolerance at this many standard errors
BAD_Z = 3.0  # a round beyond the allowance counts as bad at this many of its scales
QUIET_MIN = 30  # rounds without evidence before an alarm clears (an hour at 120 s) ...
QUIET_GAPS = 3  # ... or this many times the longest quiet spell seen during the alarm
QUIET_MAX = 720  # ... at most a day
INTERMITTENT_EPISODES = 3  # bad spells during one alarm, with at least ...
INTERMITTENT_GOOD = 0.3  # ... this share of its rounds normal: "intermittent"
SPEEDUP_ROUNDS = 30  # a speed-up held this many rounds becomes the new normal
BASE_FIRST = 3  # during the baseline, later rounds are compared with the first ones
BASE_Z = 3.0  # ... at this many scales (90% bound), at least twice the allowance ...
BASE_HITS = 2  # ... in this many rounds in a row
YOUNG_ROUNDS = 30  # the same check, against the references, for this many rounds after

# Why a device is in alarm (``DeviceTrack.reason``): its pooled CUSUM or the baseline
# check (a step), its slow level (a gradual change), a probe's own CUSUM, or on and off.
REASONS = ("", "step", "gradual", "probe", "intermittent")
STEP, GRADUAL, PROBE, INTERMITTENT = 1, 2, 3, 4
