"""Prediction without scikit-learn: every tree of a forest as flat arrays, walked together
with numpy. A fitted forest (scikit-learn's) is flattened for a few rows at a time (its
own compiled predict is faster above _FLAT_MAX_ROWS); a forest loaded from a model file is
only these arrays (persistence: the daemon predicts without importing scikit-learn), and
walks any number of rows, chunked."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

# The arrays of a flat forest, as stored (little-endian, 1-D; 22 bytes a node): per node
# its feature (0 at a leaf), threshold (inf at a leaf), children (a leaf's are itself),
# value, and whether a missing (NaN) feature goes left; per tree its root. The threshold
# is scikit-learn's float64 one rounded down to a float32: a float32 feature is <= the
# one exactly when it is <= the other (the largest float32 not above it).
NODE_ARRAYS: dict[str, str] = {"feature": "|u1", "threshold": "<f4", "left": "<i4",
                               "right": "<i4", "value": "<f8", "missing_left": "|u1"}
TREE_ARRAYS: dict[str, str] = {"roots": "<i4"}
ARRAYS: dict[str, str] = {**NODE_ARRAYS, **TREE_ARRAYS}

_CHUNK = 1 << 18  # (tree, row) pairs walked at once: bounds the walk's temporaries
MAX_FEATURES = 255  # the feature index is one byte


def _floor32(t: np.ndarray) -> np.ndarray:
    """The largest float32 <= each float64 of ``t``."""
    t32 = t.astype(np.float32)
    return np.where(t32.astype(np.float64) > t, np.nextafter(t32, np.float32(-np.inf)), t32)


class _FlatForest:
    """All trees of one forest as flat arrays, walked together with numpy.

    scikit-learn's forest.predict costs milliseconds per call for a single row (thread
    pool set-up per call); walking the trees level by level over concatenated node arrays
    gives every tree's prediction for a few rows in well under a millisecond. The walk
    compares exactly as scikit-learn's trees do (a float32 feature against its float64
    threshold, rounded down to a float32; NaN where the node sends missing values), so it
    predicts the same values.
    """

    def __init__(self, trees: Sequence[Any]):
        """From scikit-learn's fitted trees (``forest.estimators_``)."""
        feat, thr, left, right, value, miss, roots = [], [], [], [], [], [], []
        offset = 0
        depth = 0
        for est in trees:
            tr = est.tree_
            n = tr.node_count
            leaf = tr.children_left < 0
            ids = np.arange(n)
            left.append(np.where(leaf, ids, tr.children_left) + offset)
            right.append(np.where(leaf, ids, tr.children_right) + offset)
            feat.append(np.where(leaf, 0, tr.feature))
            thr.append(_floor32(np.where(leaf, np.inf, tr.threshold)))
            value.append(tr.value[:, 0, 0])
            mgl = getattr(tr, "missing_go_to_left", None)
            miss.append(np.zeros(n, dtype=bool) if mgl is None else
                        np.where(leaf, False, np.asarray(mgl).astype(bool)))
            roots.append(offset)
            offset += n
            depth = max(depth, int(tr.max_depth))
        if offset and max(int(f.max()) for f in feat) > MAX_FEATURES:
            raise ValueError(f"more than {MAX_FEATURES + 1} features")
        self._set({"feature": np.concatenate(feat), "threshold": np.concatenate(thr),
                   "left": np.concatenate(left), "right": np.concatenate(right),
                   "value": np.concatenate(value), "missing_left": np.concatenate(miss),
                   "roots": np.asarray(roots)}, depth)

    def _set(self, arrays: Mapping[str, np.ndarray], depth: int) -> None:
        a = {k: np.ascontiguousarray(arrays[k], dtype=np.dtype(d)) for k, d in ARRAYS.items()}
        self.feature, self.threshold = a["feature"], a["threshold"]
        self.left, self.right, self.value = a["left"], a["right"], a["value"]
        self.missing_left = a["missing_left"].view(bool)
        self.roots = a["roots"]
        self.depth = depth

    @classmethod
    def from_arrays(cls, arrays: Mapping[str, np.ndarray], n_features: int) -> _FlatForest:
        """From the arrays ``arrays()`` gave (read from a model file): checked to be
        trees over ``n_features`` features, each node reached once from its tree's root
        by children of higher index (no cycle, nothing out of range). ValueError, saying
        what is wrong, otherwise."""
        if set(arrays) != set(ARRAYS):
            raise ValueError(f"arrays {sorted(arrays)}, not {sorted(ARRAYS)}")
        for k, d in ARRAYS.items():
            a = arrays[k]
            if not isinstance(a, np.ndarray) or a.ndim != 1 or a.dtype != np.dtype(d):
                raise ValueError(f"array {k} is not 1-D {np.dtype(d)}")
        n = len(arrays["feature"])
        if any(len(arrays[k]) != n for k in NODE_ARRAYS) or not n:
            raise ValueError("node arrays of different lengths (or none)")
        roots, left, right = arrays["roots"], arrays["left"], arrays["right"]
        if not len(roots) or roots[0] != 0 or (np.diff(roots) <= 0).any() or roots[-1] >= n:
            raise ValueError("tree roots out of order or out of range")
        ids = np.arange(n)
        tree_end = np.append(roots[1:], n)[np.searchsorted(roots, ids, side="right") - 1]
        leaf = left == ids
        ok_leaf = leaf & (right == ids)
        ok_node = ~leaf & (left > ids) & (right > ids) & (left < tree_end) & \
            (right < tree_end)
        if not (ok_leaf | ok_node).all():
            raise ValueError("a node's children are outside its tree")
        feat = arrays["feature"]
        if (feat < 0).any() or (feat >= n_features).any():
            raise ValueError(f"features outside 0..{n_features - 1}")
        if not np.isfinite(arrays["value"]).all() or np.isnan(arrays["threshold"]).any():
            raise ValueError("values not finite or thresholds NaN")
        # Each node but a root the child of exactly one node of lower index in its tree:
        # trees, every node reached once from its root (a shared child would make the
        # walk below grow without bound).
        parents = np.bincount(np.concatenate([left[~leaf], right[~leaf]]), minlength=n)
        is_root = np.zeros(n, dtype=bool)
        is_root[roots] = True
        if (parents != np.where(is_root, 0, 1)).any():
            raise ValueError("nodes not reached exactly once from their tree's root")
        level, depth = roots.astype(np.intp), 0  # the deepest leaf, level by level
        while True:
            level = level[~leaf[level]]
            if not level.size:
                break
            depth += 1
            level = np.concatenate([left[level], right[level]]).astype(np.intp)
        self = cls.__new__(cls)
        self._set(arrays, depth)
        return self

    def arrays(self) -> dict[str, np.ndarray]:
        """The arrays that ``from_arrays`` takes back (the model file's members)."""
        return {"feature": self.feature, "threshold": self.threshold, "left": self.left,
                "right": self.right, "value": self.value,
                "missing_left": self.missing_left.view(np.uint8), "roots": self.roots}

    @property
    def n_trees(self) -> int:
        return len(self.roots)

    @property
    def node_count(self) -> int:
        return len(self.feature)

    def tree_sizes(self) -> list[tuple[int, int]]:
        """(nodes, leaves) of each tree."""
        n = len(self.feature)
        nodes = np.diff(np.append(self.roots, n))
        leaves = np.add.reduceat((self.left == np.arange(n)).astype(np.int64), self.roots)
        return [(int(a), int(b)) for a, b in zip(nodes, leaves)]

    def per_tree(self, X: np.ndarray) -> np.ndarray:
        """(trees x rows) predictions; X of float32 values (as scikit-learn sees them;
        float64 of float32 values alike). Rows are walked in chunks; a (tree, row) pair
        leaves the walk at its leaf, so the work is the paths' lengths, not the deepest
        tree's depth."""
        n_trees, n_rows = len(self.roots), X.shape[0]
        out = np.empty(n_trees * n_rows)
        if not n_rows:
            return out.reshape(n_trees, 0)
        nf = X.shape[1]
        xs = np.ascontiguousarray(X, dtype=np.float32).ravel()
        nan = bool(np.isnan(xs).any())
        step = max(1, _CHUNK // n_trees)
        for start in range(0, n_rows, step):
            rows = np.arange(start, min(start + step, n_rows))
            pos = (np.arange(n_trees)[:, None] * n_rows + rows[None, :]).ravel()
            base = np.tile(rows * nf, n_trees)  # each pair's row in xs
            node = np.repeat(self.roots, len(rows)).astype(np.intp)
            for _ in range(self.depth + 1):
                leaf = self.left[node] == node
                if leaf.any():
                    out[pos[leaf]] = self.value[node[leaf]]
                    keep = ~leaf
                    pos, base, node = pos[keep], base[keep], node[keep]
                    if not node.size:
                        break
                x = xs[base + self.feature[node]]
                go_left = x <= self.threshold[node]
                if nan:
                    go_left |= np.isnan(x) & self.missing_left[node]
                node = np.where(go_left, self.left[node], self.right[node])
        return out.reshape(n_trees, n_rows)


_FLAT_MAX_ROWS = 64  # above this, scikit-learn's compiled per-tree predict is faster


def _per_tree(rf: Any, flat: _FlatForest | None, X32: np.ndarray) -> np.ndarray:
    """(trees x rows) for scikit-learn's forest ``rf`` (its flat copy ``flat`` for a few
    rows), or a flat forest (a loaded model's) for any number of rows."""
    if isinstance(rf, _FlatForest):
        return rf.per_tree(X32)
    if flat is not None and X32.shape[0] <= _FLAT_MAX_ROWS:
        return flat.per_tree(X32)
    return np.stack([est.tree_.predict(X32)[:, 0] for est in rf.estimators_])
