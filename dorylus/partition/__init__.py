"""Partitioning a graph and the on-disk partition store that graph servers load (DESIGN §6)."""

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
    open_store,
    reassemble,
    write_store,
)

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
    "open_store",
    "partition_stats",
    "reassemble",
    "write_store",
]
