"""The in-memory graph dataset every loader returns and every other component consumes."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from dorylus.errors import DatasetError

MASK_NAMES = ("train_mask", "val_mask", "test_mask")


@dataclass
class GraphDataset:
    """A node-classification graph with ``N`` vertices, ``E`` directed edges and ``F`` features.

    Attributes:
        name: human-readable name, recorded in run and partition metadata.
        src, dst: ``int64 [E]``; edge ``k`` carries messages from ``src[k]`` to ``dst[k]``.
        features: ``float32 [N, F]``.
        labels: ``int64 [N]`` in ``[0, num_classes)``, or ``-1`` for an unlabeled vertex (which
            must then be in no mask).
        train_mask, val_mask, test_mask: ``bool [N]``.
        num_classes: ``C``.
        directed: if ``False`` (the default) the edge list is read as undirected and symmetrized
            before normalization; if ``True`` edges are used as given (forward adjacency for
            Gather, its transpose for the backward pass).
    """

    name: str
    src: np.ndarray
    dst: np.ndarray
    features: np.ndarray
    labels: np.ndarray
    train_mask: np.ndarray
    val_mask: np.ndarray
    test_mask: np.ndarray
    num_classes: int
    directed: bool = False

    @property
    def num_nodes(self) -> int:
        return int(self.features.shape[0])

    @property
    def num_edges(self) -> int:
        return int(self.src.shape[0])

    @property
    def num_features(self) -> int:
        return int(self.features.shape[1])

    def fingerprint(self) -> str:
        """sha256 (hex) of the arrays, class count and direction: the dataset's identity, checked
        when a run resumes. The name is left out: a renamed file with the same graph is the same."""
        digest = hashlib.sha256(f"{self.num_classes}:{self.directed}".encode())
        for name in ("src", "dst", "features", "labels", *MASK_NAMES):
            array = np.ascontiguousarray(getattr(self, name))
            digest.update(f"{name}:{array.dtype.str}:{array.shape}".encode())
            digest.update(memoryview(array).cast("B"))
        return digest.hexdigest()

    def validate(self, where: str | None = None) -> "GraphDataset":
        """Check shapes, dtypes, ranges and finiteness; raise one :class:`DatasetError` naming
        ``where`` (a file or object description) and the first problem found. Returns ``self``.

        Arrays are converted in place to the canonical dtypes (int64 ids and labels, float32
        features, bool masks) when that conversion is lossless.
        """
        where = where or self.name

        def fail(msg: str) -> None:
            raise DatasetError(f"{where}: {msg}")

        check_features_form(self.features, where)
        self.features = np.ascontiguousarray(self.features, dtype=np.float32)
        n = self.num_nodes

        for field in ("src", "dst"):
            ids = getattr(self, field)
            if ids.ndim != 1:
                fail(f"{field} must be 1-D, got shape {ids.shape}")
            if ids.size and not np.issubdtype(ids.dtype, np.integer):
                fail(f"{field} must hold integer vertex ids, got dtype {ids.dtype}")
            setattr(self, field, np.ascontiguousarray(ids, dtype=np.int64))
        if self.src.shape != self.dst.shape:
            fail(f"src and dst lengths differ: {self.src.shape[0]} vs {self.dst.shape[0]}")
        for field in ("src", "dst"):
            ids = getattr(self, field)
            if ids.size and (ids.min() < 0 or ids.max() >= n):
                bad = int(ids[(ids < 0) | (ids >= n)][0])
                fail(f"{field} has vertex id {bad} out of range [0, {n})")

        if self.labels.shape != (n,):
            fail(f"labels must have shape ({n},) to match features, got {self.labels.shape}")
        if not np.issubdtype(self.labels.dtype, np.integer):
            if np.issubdtype(self.labels.dtype, np.floating) and np.all(
                np.isfinite(self.labels) & (self.labels == np.round(self.labels))
            ):
                self.labels = self.labels.astype(np.int64)
            else:
                fail(f"labels must be integers, got dtype {self.labels.dtype}")
        self.labels = np.ascontiguousarray(self.labels, dtype=np.int64)
        if isinstance(self.num_classes, float) and not float(self.num_classes).is_integer():
            fail(f"num_classes must be an integer, got {self.num_classes}")
        if int(self.num_classes) < 2:
            fail(f"num_classes must be at least 2, got {self.num_classes}")
        self.num_classes = int(self.num_classes)
        if self.labels.min() < -1 or self.labels.max() >= self.num_classes:
            bad = int(self.labels[(self.labels < -1) | (self.labels >= self.num_classes)][0])
            fail(f"label {bad} out of range [0, {self.num_classes}) (-1 marks unlabeled)")
        empty = np.flatnonzero(np.bincount(self.labels[self.labels >= 0], minlength=self.num_classes) == 0)
        if empty.size:
            fail(f"{empty.size} of {self.num_classes} classes have no vertex: {_ranges(empty)} "
                 "(labels must use every class 0..C-1; is a label wrong, or num_classes?)")

        for field in MASK_NAMES:
            mask = getattr(self, field)
            if mask.shape != (n,):
                fail(f"{field} must have shape ({n},) to match features, got {mask.shape}")
            if mask.dtype != np.bool_:
                if not np.isin(mask, (0, 1)).all():
                    fail(f"{field} must be boolean (or 0/1), got values other than 0/1")
                mask = mask.astype(np.bool_)
            setattr(self, field, np.ascontiguousarray(mask))
            if np.any(self.labels[mask] < 0):
                fail(f"{field} includes unlabeled vertices (label -1)")
        for a, b in (("train", "val"), ("train", "test"), ("val", "test")):
            overlap = getattr(self, f"{a}_mask") & getattr(self, f"{b}_mask")
            if overlap.any():
                fail(f"{a}_mask and {b}_mask overlap ({int(overlap.sum())} vertices, first {int(np.argmax(overlap))})")
        if not self.train_mask.any():
            fail("train_mask is empty: nothing to train on")

        # In row blocks: a whole-matrix isfinite would be an N x F bool temporary (and would
        # fault every page of a memory-mapped matrix into this process at once).
        step = max(1, (64 << 20) // max(1, self.num_features))
        for lo in range(0, n, step):
            finite = np.isfinite(self.features[lo : lo + step])
            if not finite.all():
                row, col = np.argwhere(~finite)[0]
                fail(f"features contain NaN or inf (first at vertex {lo + row}, column {col})")
        return self


def check_features_form(features: np.ndarray, where: str) -> None:
    """The checks of a feature matrix that need no pass over its values: 2-D, numeric, at least
    one row and one column (:meth:`GraphDataset.validate` and the streaming readers share them)."""
    if features.ndim != 2:
        raise DatasetError(f"{where}: features must be 2-D [num_nodes, num_features], got shape {features.shape}")
    if not (np.issubdtype(features.dtype, np.floating) or np.issubdtype(features.dtype, np.integer)
            or features.dtype == np.bool_):
        raise DatasetError(f"{where}: features must be numeric, got dtype {features.dtype}")
    if features.shape[0] == 0:
        raise DatasetError(f"{where}: graph has no vertices")
    if features.shape[1] == 0:
        raise DatasetError(f"{where}: features have 0 columns (shape {features.shape}); a model needs at least "
                           "one input feature")


def _ranges(values: np.ndarray, limit: int = 6) -> str:
    """``[1, 2, 3, 7]`` -> ``"1..3, 7"`` (at most ``limit`` ranges, then an ellipsis)."""
    runs: list[list[int]] = []
    for v in values.tolist():
        if runs and v == runs[-1][1] + 1:
            runs[-1][1] = v
        else:
            runs.append([v, v])
    text = ", ".join(str(a) if a == b else f"{a}..{b}" for a, b in runs[:limit])
    return text + (", ..." if len(runs) > limit else "")
