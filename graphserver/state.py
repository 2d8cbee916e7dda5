"""A graph server's partition state: local adjacency, intervals, and the model's row buffers.

Local rows are ``[owned; ghosts]`` (see :mod:`dorylus.partition.store`). The model's plan
(:mod:`dorylus.models.base`) names the buffers; each is float32 ``[n_owned, width]``, or
``[n_local, width]`` when Gather reads it (its ghost rows come from the peers). The static
inputs ``X``, ``ids``, ``labels`` and ``split`` hold the owned rows only; ``X`` is
:class:`~dorylus.models.sparse.SparseRows` when the features are kept sparse
(``sparse_features``, :func:`dorylus.models.sparse.in_layout`), whatever layout the store has.
"""

from __future__ import annotations

import numpy as np

from dorylus.models.base import STATIC, Plan
from dorylus.models.graph import CsrGraph
from dorylus.models.ops import encode_split
from dorylus.models.sparse import SparseRows, in_layout
from dorylus.normalize import row_normalize
from dorylus.partition import Partition


def split_intervals(num_rows: int, count: int) -> list[tuple[int, int]]:
    """``count`` contiguous, near-equal ``[start, stop)`` ranges covering ``num_rows`` rows
    (fewer when there are fewer rows than intervals; at least one)."""
    count = max(1, min(count, num_rows))
    bounds = np.linspace(0, num_rows, count + 1).round().astype(int)
    return [(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]


class PartitionState:
    def __init__(self, part: Partition, plan: Plan, *, row_normalize_features: bool, num_intervals: int,
                 sparse_features: str = "auto"):
        self.part = part
        n_owned, n_local = part.n_owned, part.n_local
        self.global_ids = part.global_ids()
        self.intervals = split_intervals(n_owned, num_intervals)
        # Gather reads [owned; ghost] rows; each interval gathers its own rows (a row block), so
        # that its function can start without waiting for the other intervals.
        self.graph = CsrGraph(part.indptr, part.indices, part.weights, n_local, self.global_ids[:n_owned],
                              self.global_ids)
        features = in_layout(part.features, sparse_features)
        if row_normalize_features:
            features = row_normalize(features)
        self.static = {
            "X": features if isinstance(features, SparseRows) else np.ascontiguousarray(features),
            "ids": np.ascontiguousarray(self.global_ids[:n_owned]),
            "labels": np.ascontiguousarray(part.labels, dtype=np.int64),
            "split": encode_split(part.train_mask, part.val_mask, part.test_mask),
        }
        used = {name for stage in (*plan.train, *plan.evaluate) for name in (*stage.reads, *stage.writes)}
        self.buffers = {name: np.zeros((n_local if name in plan.ghosted else n_owned, plan.widths[name]), np.float32)
                        for name in sorted(used - set(STATIC))}

    @property
    def n_owned(self) -> int:
        return self.part.n_owned

    def rows(self, name: str) -> np.ndarray:
        """The buffer or static input ``name`` (KeyError if the model has none such)."""
        return self.static[name] if name in self.static else self.buffers[name]
