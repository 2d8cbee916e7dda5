"""Where every vertex goes, and the store that records it: one path for ``dorylus partition``
and for ``dorylus train`` when it partitions at start.

:func:`assign` picks the method (``auto``: METIS where its memory estimate fits the budget, else
Fennel, :func:`~dorylus.partition.partitioner.choose_method`) and assigns the parts;
:meth:`Placement.write` writes the store: from the whole dataset in memory for METIS and the
in-memory methods, or part by part from in-edge buckets on disk for the streaming ones, so that a
graph that METIS cannot hold is never held whole either.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from dorylus.data.graph import GraphDataset
from dorylus.data.loaders import EdgeStream
from dorylus.partition.partitioner import METHODS, assign_parts, choose_method
from dorylus.partition.streaming import (
    DEFAULT_CHUNK_EDGES, DEFAULT_IMBALANCE, DEFAULT_PASSES, STREAMING_METHODS, check_streaming_args, stream_assign,
    write_streamed_store,
)

CHOICES = ("auto", *METHODS)  # METHODS lists the streaming ones too
Progress = Callable[[str], None]


@dataclass
class StreamOptions:
    """How the streaming methods read and refine (``dorylus partition``'s options)."""

    passes: int = DEFAULT_PASSES
    imbalance: float = DEFAULT_IMBALANCE
    chunk_edges: int = DEFAULT_CHUNK_EDGES
    tmp_dir: Path | None = None
    memory_budget_bytes: int | None = None  # auto's budget for METIS (None: a share of available memory)


@dataclass
class Placement:
    """A part per vertex (``int64 [N]``), the method that chose it, and the graph to write."""

    method: str
    parts: np.ndarray
    num_parts: int
    stream: EdgeStream
    options: StreamOptions

    def write(self, out: str | Path, *, seed: int, overwrite: bool = False, sparse_features: str = "auto",
              progress: Progress | None = None) -> None:
        from dorylus.partition.store import write_store

        if self.method in STREAMING_METHODS:
            write_streamed_store(self.stream, self.parts, Path(out), num_parts=self.num_parts, method=self.method,
                                 seed=seed, overwrite=overwrite, sparse_features=sparse_features,
                                 chunk_edges=self.options.chunk_edges, tmp_dir=self.options.tmp_dir,
                                 progress=progress)
        else:
            dataset = self.stream.in_memory
            write_store(dataset, self.parts, out, method=self.method, seed=seed, overwrite=overwrite,
                        sparse_features=sparse_features, progress=progress)


def assign(stream: EdgeStream, num_parts: int, method: str, *, seed: int = 0, options: StreamOptions | None = None,
           load: Callable[[], GraphDataset] | None = None, progress: Progress | None = None) -> Placement:
    """Assign ``stream``'s vertices to ``num_parts`` parts with ``method`` (one of :data:`CHOICES`).

    The in-memory methods need the whole dataset: ``stream.in_memory``, or ``load()`` when the
    stream reads from disk (then called once, only if such a method is chosen)."""
    options = options or StreamOptions()
    say = progress or (lambda message: None)
    if method == "auto":
        stream.count_edges(options.chunk_edges)
        method, why = choose_method(stream.num_nodes, stream.num_edges, stream.symmetric,
                                    options.memory_budget_bytes)
        say(f"partition method auto: {why}")
    start = time.perf_counter()
    if method in STREAMING_METHODS:
        stream.count_edges(options.chunk_edges)
        check_streaming_args(stream.num_nodes, num_parts, method, options.passes, options.imbalance,
                             options.chunk_edges)
        parts = stream_assign(stream.num_nodes, lambda: stream.chunks(options.chunk_edges), num_parts, method,
                              seed=seed, passes=options.passes, imbalance=options.imbalance,
                              num_edges=max(1, stream.num_edges // 2 if stream.symmetric else stream.num_edges),
                              progress=say)
    else:
        if stream.in_memory is None:
            stream.in_memory = load() if load is not None else None
            if stream.in_memory is None:
                raise ValueError(f"{method} needs the dataset in memory; pass load=")
        data = stream.in_memory
        parts = assign_parts(data.num_nodes, data.src, data.dst, num_parts, method, seed=seed)
    say(f"{method} assignment into {num_parts} parts ({time.perf_counter() - start:.1f} s)")
    return Placement(method, parts, num_parts, stream, options)
