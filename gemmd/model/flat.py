"""Fast prediction: every tree of a forest as flat arrays, walked together with numpy
(for a few rows; scikit-learn's own per-tree predict above _FLAT_MAX_ROWS)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


class _FlatForest:
    """All trees of one forest as flat arrays, walked together with numpy.

    scikit-learn's forest.predict costs milliseconds per call for a single row (thread
    pool set-up per call); walking the trees level by level over concatenated node arrays
    gives every tree's prediction for a few rows in well under a millisecond.
    """

    def __init__(self, trees: Sequence[Any]):
        feat, thr, left, right, value, roots = [], [], [], [], [], []
        offset = 0
        self.depth = 0
        for est in trees:
            tr = est.tree_
            n = tr.node_count
            leaf = tr.children_left < 0
            ids = np.arange(n)
            left.append(np.where(leaf, ids, tr.children_left) + offset)
            right.append(np.where(leaf, ids, tr.children_right) + offset)
            feat.append(np.where(leaf, 0, tr.feature))
            thr.append(np.where(leaf, np.inf, tr.threshold))
            value.append(tr.value[:, 0, 0])
            roots.append(offset)
            offset += n
            self.depth = max(self.depth, int(tr.max_depth))
        self.feature = np.concatenate(feat).astype(np.intp)
        self.threshold = np.concatenate(thr)
        self.left = np.concatenate(left).astype(np.intp)
        self.right = np.concatenate(right).astype(np.intp)
        self.value = np.concatenate(value)
        self.roots = np.asarray(roots, dtype=np.intp)

    def per_tree(self, X: np.ndarray) -> np.ndarray:
        """(trees x rows) predictions; X as float64 of float32 values, as scikit-learn sees."""
        rows = np.arange(X.shape[0])[None, :]
        node = np.repeat(self.roots[:, None], X.shape[0], axis=1)
        for _ in range(self.depth):
            go_left = X[rows, self.feature[node]] <= self.threshold[node]
            node = np.where(go_left, self.left[node], self.right[node])
        return self.value[node]


_FLAT_MAX_ROWS = 64  # above this, scikit-learn's compiled per-tree predict is faster


def _per_tree(rf: Any, flat: _FlatForest | None, X32: np.ndarray) -> np.ndarray:
    if flat is not None and X32.shape[0] <= _FLAT_MAX_ROWS:
        return flat.per_tree(X32.astype(np.float64))
    return np.stack([est.tree_.predict(X32)[:, 0] for est in rf.estimators_])
