"""The fleet report: per GPU, the daemon's sentinel probes over time, from its store.

For each GPU: the deployed model's live error per probe (median |measured / predicted - 1|
over the window), measured / predicted over time for every probe and target with the
results taken in drift alarm and the model changes marked, each probe's measured and
predicted runtime, power and energy with the prediction interval, and the device context
recorded with each probe (SM clock, temperature, power limit, clock-event reasons).

What the store keeps and what it does not (said on the page too): each result's
prediction with its interval, the model version that made it, whether the GPU was in
drift alarm when it was taken (``flagged``) and the device context; and its events: drift
alarms raised and cleared per target (the pooled statistic or a probe's own), rebaselines,
models activated. Results stored before intervals were (schema 2) get theirs re-computed
from the model files still kept (``model.keep``) with the same model, which gives the
daemon's interval exactly. A store the daemon has not migrated yet (schema 2) is read as
it is: no events there, alarms only by flagged results. The drift statistics over time are
not recorded (Prometheus has them).

By section, in layers: ``data`` (each GPU's series and context), ``alarms`` (drift state
and alarm spans), ``tables``, ``figures``, and ``assemble`` (``write_fleet``: the page).
"""

from gemmd.report.fleet.assemble import write_fleet

__all__ = ["write_fleet"]
