"""Partition quality: sizes, ghosts, communication volume, edge cut and balance.

Per part ``i``: ``owned`` vertices, ``nnz`` in-edges (``A_hat`` entries of owned rows, self-loops
included), ``cut`` (those whose source is remote), ``ghosts`` (distinct remote in-neighbours: the
rows received per Scatter), ``ghost_ratio = ghosts / owned`` and ``send`` (rows sent to all peers
per Scatter). Global: ``edge_cut`` (off-diagonal ``A_hat`` entries whose endpoints lie in
different parts), ``edge_cut_fraction`` (of all off-diagonal entries, i.e. edges after
symmetrization), ``balance = max owned / mean owned`` (1.0 is perfect) and ``edge_balance``, the
same of the parts' in-edges (their Gather work).

Two independent routes compute the same numbers: from a written store (what ``dorylus inspect``
shows) and from an assignment plus the global ``A_hat`` (before anything is written).
"""

from __future__ import annotations

import numpy as np

from dorylus.normalize import NormalizedAdjacency
from dorylus.normalize import sorted_unique
from dorylus.partition.store import PartitionStore


def partition_stats(source: PartitionStore | np.ndarray, adjacency: NormalizedAdjacency | None = None) -> dict:
    """Statistics of a partitioning.

    Args:
        source: an opened :class:`PartitionStore`, or an ``int [N]`` part assignment (then
            ``adjacency``, the global ``A_hat``, is required).

    Returns:
        ``{"parts": [{"part", "owned", "nnz", "cut", "ghosts", "ghost_ratio", "send"}, ...],
        "global": {"num_parts", "num_nodes", "nnz", "edges", "edge_cut", "edge_cut_fraction",
        "balance", "ghosts", "send"}}``, plain ints and floats (JSON-serializable).
    """
    if isinstance(source, PartitionStore):
        rows = []
        for i in range(source.num_parts):
            p = source.load_part(i, mmap=True)
            rows.append((p.n_owned, p.nnz, int(np.count_nonzero(p.indices >= p.n_owned)), p.n_ghost,
                         int(p.send_offsets[-1])))
        owned, nnz, cut, ghosts, send = (np.array(col, dtype=np.int64) for col in zip(*rows))
    else:
        if adjacency is None:
            raise TypeError("partition_stats(parts, adjacency): adjacency is required with an assignment")
        parts = np.asarray(source, dtype=np.int64)
        num_parts = int(parts.max()) + 1
        row_part = parts[adjacency.rows()]
        col_part = parts[adjacency.indices]
        cross = row_part != col_part
        holders = row_part[cross]
        # A ghost is a distinct (holding part, remote vertex) pair.
        pairs = sorted_unique(holders * np.int64(adjacency.num_nodes) + adjacency.indices[cross])
        owned = np.bincount(parts, minlength=num_parts)
        nnz = np.bincount(row_part, minlength=num_parts)
        cut = np.bincount(holders, minlength=num_parts)
        ghosts = np.bincount(pairs // adjacency.num_nodes, minlength=num_parts)
        send = np.bincount(parts[pairs % adjacency.num_nodes], minlength=num_parts)

    num_nodes, total_nnz = int(owned.sum()), int(nnz.sum())
    edges = total_nnz - num_nodes
    per_part = [
        {"part": i, "owned": int(owned[i]), "nnz": int(nnz[i]), "cut": int(cut[i]), "ghosts": int(ghosts[i]),
         "ghost_ratio": float(ghosts[i] / owned[i]), "send": int(send[i])}
        for i in range(owned.shape[0])
    ]
    return {
        "parts": per_part,
        "global": {
            "num_parts": int(owned.shape[0]), "num_nodes": num_nodes, "nnz": total_nnz, "edges": edges,
            "edge_cut": int(cut.sum()), "edge_cut_fraction": float(cut.sum() / edges) if edges else 0.0,
            "balance": float(owned.max() / owned.mean()), "edge_balance": float(nnz.max() / nnz.mean()),
            "ghosts": int(ghosts.sum()), "send": int(send.sum()),
        },
    }


def format_stats(stats: dict) -> str:
    """A readable table of :func:`partition_stats` output, one row per part plus totals."""
    header = ("part", "owned", "in-edges", "cut in-edges", "ghosts", "ghosts/owned", "send rows")
    body = [
        (str(p["part"]), f"{p['owned']:,}", f"{p['nnz']:,}", f"{p['cut']:,}", f"{p['ghosts']:,}",
         f"{p['ghost_ratio']:.3f}", f"{p['send']:,}")
        for p in stats["parts"]
    ]
    g = stats["global"]
    body.append(("total", f"{g['num_nodes']:,}", f"{g['nnz']:,}", f"{g['edge_cut']:,}", f"{g['ghosts']:,}",
                 f"{g['ghosts'] / g['num_nodes']:.3f}", f"{g['send']:,}"))
    widths = [max(len(row[c]) for row in (header, *body)) for c in range(len(header))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in (header, *body)]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.insert(-1, lines[1])
    lines.append(
        f"edge cut: {g['edge_cut']:,} of {g['edges']:,} edges ({100 * g['edge_cut_fraction']:.2f}%); "
        f"balance (max/mean owned): {g['balance']:.3f}, of in-edges: {g['edge_balance']:.3f}"
    )
    return "\n".join(lines)
