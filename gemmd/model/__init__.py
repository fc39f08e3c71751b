"""Fit, predict (with intervals), save and load the performance model.

Two predictors share one interface: the analytical roofline estimate used until enough
probes exist, and a Random Forest per target (runtime, power, energy) trained on stored
probes or imported measurements. Targets are learned in log space relative to physics
(runtime / roofline time, power / power limit, energy / FLOP) so that the forest predicts
efficiency, which carries to unseen sizes. Repeats of a configuration are fitted as one
row (their median); energy is power x runtime where the data agree. Intervals combine the
spread of the trees with the noise of a single measurement. Every prediction stays inside
the physical bounds of its GPU (gemmd.bounds); how far other GPUs' data carry to a GPU
never trained on, and a new GPU's first probes to the rest of its GEMMs, is what
leave-one-GPU-out validation on the training data measured at fit time (_validate).
docs/model.md has the why ("What the model trusts").

The modules, each importing only those above it:
space (the roofline predictor, target spaces), flat (fast prediction), intervals
(fitting, noise, intervals), repeats (repeated configurations, seen shapes), domain (the
training domain), offsets (a device's offsets from a prior), validation (at fit time),
persistence (the model file), forest (ForestModel), calibration (calibrate), choosing
(what a new GPU's probes choose between), transfer (TransferModel).
"""

from gemmd.gemm import TARGETS
from gemmd.model.choosing import describe_calibration
from gemmd.model.forest import ForestModel
from gemmd.model.repeats import shape_hashes
from gemmd.model.space import RooflinePredictor, table_hash
from gemmd.model.transfer import TransferModel

__all__ = ["TARGETS", "ForestModel", "RooflinePredictor", "TransferModel",
           "describe_calibration", "shape_hashes", "table_hash"]
