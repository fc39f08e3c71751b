"""`gemmd report`: one self-contained HTML file of figures (matplotlib, inline SVG).

Two reports:

- the model report (:func:`write`): gemmd's model and GPPerf's pipeline refitted on a
  training split of measurements and judged on the held-out rows, and the deployed model
  (the state directory's active one) judged as it is on the same rows;
- the fleet report (:func:`write_fleet`): per GPU, from the daemon's store, each sentinel
  probe's measured against predicted runtime, power and energy over time with the
  prediction interval, drift alarms, model changes, clocks and clock-event reasons, and
  the deployed model's live error.

``out`` is an .html file (:func:`check_out`); it is written atomically. Every expected
problem raises a one-line GemmdError (InputError for ``out`` and the data, StoreError for
the store).
"""

from gemmd.report.comparison import work_units, write
from gemmd.report.fleet import write_fleet
from gemmd.report.page import MIN_ROWS, check_out

__all__ = ["MIN_ROWS", "check_out", "work_units", "write", "write_fleet"]
