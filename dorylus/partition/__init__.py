"""Partitioning a graph and the on-disk partition store that graph servers load (DESIGN §6)."""

from __future__ import annotations

import os
from typing import Iterable

from dorylus.partition.partitioner import METHODS, assign_parts
from dorylus.partition.stats import format_stats, partition_stats
from dorylus.partition.store import (
    FORMAT_VERSION,
    Partition,
    VERTEX_ORDERS,
    PartitionStore,
    StoreMeta,
    StoreWriter,
    check_store_target,
    open_dir,
    reassemble,
    write_store,
)
from dorylus.partition import s3


# Where a store path is told apart from an S3 URL (s3.is_url, the one test): store.py knows
# directories only, s3.py builds on it, and these two dispatch between them.
def open_store(path: str | os.PathLike, verify: bool = True, *, parts: Iterable[int] | None = None) -> PartitionStore:
    """Open the partition store at ``path``, a directory or ``s3://BUCKET/PREFIX`` (the store,
    ``parts`` only, default all, is then fetched into the local cache first): see
    :func:`~dorylus.partition.store.open_dir` for ``verify``."""
    parts = None if parts is None else list(parts)
    if s3.is_url(path):
        path = s3.fetch_store(path, parts=parts)
    return open_dir(path, verify, parts=parts)


def read_meta(path: str | os.PathLike) -> StoreMeta:
    """The checked ``meta.json`` of the store at ``path`` (a directory or ``s3://``), without
    downloading or verifying any part."""
    if s3.is_url(path):
        return s3.read_store_meta(path)
    return open_dir(path, verify=False).meta


__all__ = [
    "FORMAT_VERSION",
    "METHODS",
    "Partition",
    "PartitionStore",
    "StoreMeta",
    "StoreWriter",
    "VERTEX_ORDERS",
    "assign_parts",
    "check_store_target",
    "format_stats",
    "open_dir",
    "open_store",
    "partition_stats",
    "read_meta",
    "reassemble",
    "write_store",
]
