r"""The partition store (DESIGN §6): a partitioned dataset as a directory of ``.npy`` files.

Layout (format 3), for ``P`` parts of a graph with ``N`` vertices::

    meta.json            format version, dataset, global counts, partitioner, vertex order, per-file sha256
    part-<i>/owned.npy          int64 [n_owned]      global ids owned by part i, in local order
                                                     (the store's vertex order, not ascending)
    part-<i>/ghosts.npy         int64 [n_ghost]      remote in-neighbours of owned vertices, by
                                                     owning part, then by the first row reading them
    part-<i>/ghost_offsets.npy  int64 [P + 1]        ghosts[o[j]:o[j+1]] are owned by part j
    part-<i>/indptr.npy         int64 [n_owned + 1]  CSR of the pattern of A + I on owned rows ...
    part-<i>/indices.npy        int32 [nnz_i]        ... source in *local* ids, ascending in a row
                                                     (int64 when n_local >= 2^31)
    part-<i>/norm.npy           float32 [n_local]    (1 + global in-degree)^-1/2 of each local vertex
    part-<i>/features.npy       float32 [n_owned, F] raw (row normalization happens at training),
                                                     or, for a part whose features are sparse (CSR):
    part-<i>/features_data.npy     float32 [k]          ... the non-zeros, row by row,
    part-<i>/features_indices.npy  int32 [k]            ... their columns, ascending in a row
                                                     (int64 when F >= 2^31),
    part-<i>/features_indptr.npy   int64 [n_owned + 1]  ... row i's at [indptr[i], indptr[i+1])
    part-<i>/labels.npy         int64 [n_owned]
    part-<i>/{train,val,test}_mask.npy  bool [n_owned]
    part-<i>/send_indices.npy   int64 [n_send]       local owned ids that other parts hold ...
    part-<i>/send_offsets.npy   int64 [P + 1]        ... send_indices[s[j]:s[j+1]] go to part j

Local ids: ``k < n_owned`` is ``owned[k]``; ``n_owned + g`` is ``ghosts[g]``; row ``k``'s self
loop is column ``k``. ``A_hat = D^-1/2 (A + I) D^-1/2`` with the whole graph's degrees, so
``A_hat[v, u] = norm[v] norm[u]`` and partition ``i``'s Gather
``Z[v] = norm[v] sum_u norm[u] H[u]`` over local rows equals the global one (up to the order of
the float32 sum). Part ``i``'s send block for ``j`` lists, in the same order, the vertices of part
``j``'s ghost block for ``i``: ghost exchange is a plain row copy.

Vertex order (``meta.json`` ``"vertex_order"``): owned vertices are numbered for locality inside
each part when the store is written, from the part's internal edges: ``community`` (the default:
label-propagation communities, each in reverse Cuthill-McKee order, seeded by the store's seed),
``rcm`` (reverse Cuthill-McKee alone), ``bfs`` (breadth-first from a least-degree vertex) or
``none`` (ascending global id). Ghosts follow the rows that read them. Every result leaves the
graph servers keyed by global id (the ``ids`` input), so training does not depend on the order.

Features are stored sparse when :func:`dorylus.models.sparse.use_sparse` says so for the
``sparse_features`` mode (``auto``: below 10% non-zeros, as bag-of-words; :func:`write_store`
decides on the whole matrix, :class:`StoreWriter` per part). A part's entry in ``meta.json``
records its layout (``"features": "dense" | "csr"``, with ``features_nnz`` for CSR).

``format_version`` 3 is read; stores of versions 1 and 2 (int64 indices, a per-entry
``weights.npy``, ascending ``owned``) are refused with how to rebuild them: converting one
would cost as much as partitioning again.

Writing is atomic and part by part (:class:`StoreWriter`, which :func:`write_store` drives):
everything goes to a temp directory next to the target, which is renamed into place only when
complete. Verification of sha256 checksums happens in :func:`open_dir` (all parts,
``verify=True``) or per part with :meth:`PartitionStore.verify`; :meth:`load_part` always checks
presence, dtypes, shapes and index ranges (cheap relative to training).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Callable, Iterable

import numpy as np

from dorylus import __version__, atomic
from dorylus.data.graph import MASK_NAMES, GraphDataset
from dorylus.errors import ConfigError, StoreError
from dorylus.models.sparse import SPARSE_MODES, SparseRows, density, index_dtype, use_sparse
from dorylus.normalize import NormalizedAdjacency, edge_keys, gcn_norm, vertex_dtype
from dorylus.runs import check_creatable_dir

FORMAT_VERSION = 3
READ_VERSIONS = (3,)
NORMALIZATION = "gcn-sym-selfloop"
VERTEX_ORDERS = ("community", "rcm", "bfs", "none")
META_FILE = "meta.json"
# The files of a part: these, and the features' files of its layout.
GRAPH_FILES = (
    "owned", "ghosts", "ghost_offsets", "indptr", "indices", "norm",
    "labels", *MASK_NAMES, "send_indices", "send_offsets",
)
FEATURE_FILES = {"dense": ("features",), "csr": ("features_data", "features_indices", "features_indptr")}
_HASH_CHUNK = 8 << 20
_EDGE_CHUNK = 1 << 22  # edge keys scanned per step when splitting the edges by part (bounds the temporaries)


def part_file(part: int, name: str) -> str:
    """Path of one array file relative to the store root, as listed in ``meta.json``."""
    return f"part-{part}/{name}.npy"


def rebuild_hint(store: str) -> str:
    return (f"rebuild it with `dorylus partition --dataset DATASET --out {store} --overwrite` (or run "
            "`dorylus train` without --partitions, which partitions into the run directory)")


@dataclass
class StoreMeta:
    """The contents of ``meta.json``. ``parts[i]`` holds ``num_owned``, ``num_ghosts``, ``nnz``
    and ``features`` (layout) of part ``i``; ``files`` maps each relative file path to its sha256."""

    format_version: int
    dataset: str
    num_nodes: int
    num_edges: int
    nnz: int
    num_features: int
    num_classes: int
    directed: bool
    symmetrized: bool
    normalization: str
    num_parts: int
    partitioner: str
    seed: int
    vertex_order: str
    train_count: int
    val_count: int
    test_count: int
    parts: list
    files: dict
    created_by: str

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1) + "\n"

    @classmethod
    def from_json(cls, text: str, where: str) -> "StoreMeta":
        """Parse and check ``meta.json`` text; ``where`` names the file in errors."""
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise StoreError(f"{where}: not valid JSON ({exc})") from None
        if not isinstance(raw, dict):
            raise StoreError(f"{where}: expected a JSON object, got {type(raw).__name__}")
        version = raw.get("format_version")
        if version not in READ_VERSIONS or isinstance(version, bool):
            store = os.path.dirname(where) or "."
            older = isinstance(version, int) and not isinstance(version, bool) and version < min(READ_VERSIONS)
            raise StoreError(
                f"partition store {store} has format version {version}"
                + (" (int64 indices and per-entry weights, from an older dorylus)" if older else "")
                + f"; this dorylus reads {', '.join(map(str, READ_VERSIONS))}: {rebuild_hint(store)}"
            )
        kinds = {"str": str, "int": int, "bool": bool, "list": list, "dict": dict}
        for f in fields(cls):
            kind = kinds[f.type]
            value = raw.get(f.name)
            if f.name not in raw:
                raise StoreError(f"{where}: missing key {f.name!r}")
            if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
                raise StoreError(f"{where}: {f.name!r} must be {f.type}, got {value!r}")
        meta = cls(**{f.name: raw[f.name] for f in fields(cls)})
        if meta.vertex_order not in VERTEX_ORDERS:
            raise StoreError(f"{where}: 'vertex_order' must be one of {', '.join(VERTEX_ORDERS)}, "
                             f"got {meta.vertex_order!r}")
        if meta.num_parts < 1 or len(meta.parts) != meta.num_parts:
            raise StoreError(f"{where}: 'parts' has {len(meta.parts)} entries for num_parts {meta.num_parts}")
        for i, entry in enumerate(meta.parts):
            if not isinstance(entry, dict) or not all(
                isinstance(entry.get(k), int) and entry[k] >= 0 for k in ("num_owned", "num_ghosts", "nnz")
            ):
                raise StoreError(f"{where}: parts[{i}] needs non-negative integers num_owned, num_ghosts, nnz")
            if entry.get("features") not in FEATURE_FILES:
                raise StoreError(f"{where}: parts[{i}] 'features' must be one of {', '.join(FEATURE_FILES)}, "
                                 f"got {entry.get('features')!r}")
            nnz = entry.get("features_nnz")
            if entry["features"] == "csr" and (not isinstance(nnz, int) or isinstance(nnz, bool) or nnz < 0):
                raise StoreError(f"{where}: parts[{i}] has CSR features but no non-negative integer 'features_nnz'")
        if sum(p["num_owned"] for p in meta.parts) != meta.num_nodes:
            raise StoreError(f"{where}: parts own {sum(p['num_owned'] for p in meta.parts)} vertices, num_nodes is {meta.num_nodes}")
        for i in range(meta.num_parts):
            for rel in meta.part_files(i):
                if rel not in meta.files:
                    raise StoreError(f"{where}: 'files' does not list {rel}")
        return meta

    def feature_layout(self, part: int) -> str:
        """``"dense"`` or ``"csr"``: how part ``part`` stores its features."""
        return self.parts[part]["features"]

    def part_files(self, part: int) -> list[str]:
        """The paths (relative to the store root) of part ``part``'s files."""
        return [part_file(part, name) for name in (*GRAPH_FILES, *FEATURE_FILES[self.feature_layout(part)])]


@dataclass
class Partition:
    """One part's arrays (see the module docstring for the layout); memory-mapped read-only
    when loaded with ``mmap=True``. ``features`` is a ``float32 [n_owned, F]`` array, or
    :class:`~dorylus.models.sparse.SparseRows` when the part stores them as CSR."""

    part_id: int
    num_parts: int
    owned: np.ndarray
    ghosts: np.ndarray
    ghost_offsets: np.ndarray
    indptr: np.ndarray
    indices: np.ndarray
    norm: np.ndarray
    features: np.ndarray | SparseRows
    labels: np.ndarray
    train_mask: np.ndarray
    val_mask: np.ndarray
    test_mask: np.ndarray
    send_indices: np.ndarray
    send_offsets: np.ndarray
    # The store's graph is undirected (stored both ways): the owned rows' block of the pattern,
    # ``S[:, :n_owned]``, is symmetric (its rows ascend, as every stored row does).
    undirected: bool = False

    @property
    def n_owned(self) -> int:
        return int(self.owned.shape[0])

    @property
    def n_ghost(self) -> int:
        return int(self.ghosts.shape[0])

    @property
    def n_local(self) -> int:
        return self.n_owned + self.n_ghost

    @property
    def nnz(self) -> int:
        return int(self.indices.shape[0])

    def global_ids(self) -> np.ndarray:
        """``int64 [n_local]``: global id of each local id."""
        return np.concatenate([self.owned, self.ghosts])

    def ghost_rows(self, peer: int) -> slice:
        """Local rows that hold the ghosts owned by ``peer`` (where its sent rows are copied)."""
        return slice(self.n_owned + int(self.ghost_offsets[peer]), self.n_owned + int(self.ghost_offsets[peer + 1]))

    def send_rows(self, peer: int) -> np.ndarray:
        """Local owned rows to send to ``peer``, in the order of its ghost block for this part."""
        return self.send_indices[self.send_offsets[peer]:self.send_offsets[peer + 1]]


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


class PartitionStore:
    """An opened partition store: ``meta`` plus per-part loading. Create with :func:`open_dir`."""

    def __init__(self, path: Path, meta: StoreMeta):
        self.path = path
        self.meta = meta

    @property
    def num_parts(self) -> int:
        return self.meta.num_parts

    def fingerprint(self) -> str:
        """sha256 (hex) of ``meta.json``, which holds every file's sha256: the store's identity."""
        return hashlib.sha256(self.meta.to_json().encode()).hexdigest()

    def verify(self, parts: Iterable[int] | None = None) -> None:
        """Check the sha256 of every file of the given parts (all files if ``None``), reading in
        chunks. Raises :class:`StoreError` naming the first missing or corrupt file."""
        if parts is None:
            names = list(self.meta.files)
        else:
            names = [rel for i in parts for rel in self.meta.part_files(self._check_part(i))]
        for rel in names:
            path = self.path / rel
            if not path.is_file():
                raise StoreError(f"partition store {self.path}: missing file {rel}")
            actual = _sha256_file(path)
            if actual != self.meta.files[rel]:
                raise StoreError(
                    f"partition store {self.path}: {rel} is corrupt (sha256 {actual[:16]}..., "
                    f"meta.json records {str(self.meta.files[rel])[:16]}...)"
                )

    def _check_part(self, part: int) -> int:
        if not 0 <= int(part) < self.num_parts:
            raise StoreError(f"partition store {self.path} has parts 0..{self.num_parts - 1}, not part {part}")
        return int(part)

    def load_part(self, part: int, mmap: bool = True) -> Partition:
        """Load part ``part``, checking every array's dtype, shape and index range (errors name
        the file). ``mmap=True`` maps the files read-only instead of reading them: the index
        arrays are then the page cache's, shared by every process that maps them."""
        i = self._check_part(part)
        meta, p_count, expect = self.meta, self.meta.num_parts, self.meta.parts[i]

        def load(name: str, dtype, shape: tuple) -> np.ndarray:
            rel = part_file(i, name)
            path = self.path / rel
            if not path.is_file():
                raise StoreError(f"partition store {self.path}: missing file {rel}")
            try:
                array = np.load(path, mmap_mode="r" if mmap else None, allow_pickle=False)
            except (OSError, ValueError) as exc:
                raise StoreError(f"partition store {self.path}: {rel} is not a readable .npy file ({exc})") from None
            if array.dtype != dtype or array.shape != shape:
                raise StoreError(
                    f"partition store {self.path}: {rel} has dtype {array.dtype} shape {array.shape}, "
                    f"expected {np.dtype(dtype)} {shape}"
                )
            return array

        def require(ok: bool, name: str, problem: str) -> None:
            if not ok:
                raise StoreError(f"partition store {self.path}: {part_file(i, name)}: {problem}")

        def check_offsets(name: str, offsets: np.ndarray, total: int) -> None:
            require(offsets[0] == 0 and offsets[-1] == total and bool(np.all(np.diff(offsets) >= 0)),
                    name, f"offsets must rise from 0 to {total}")
            require(offsets[i] == offsets[i + 1], name, f"part {i} cannot exchange rows with itself")

        n_owned, n_ghost, nnz = expect["num_owned"], expect["num_ghosts"], expect["nnz"]
        n_local = n_owned + n_ghost
        owned = load("owned", np.int64, (n_owned,))
        ordered = np.sort(owned)
        require(n_owned == 0 or (ordered[0] >= 0 and ordered[-1] < meta.num_nodes
                                 and bool(np.all(np.diff(ordered) > 0))),
                "owned", f"global ids must be distinct and in [0, {meta.num_nodes})")
        del ordered
        ghosts = load("ghosts", np.int64, (n_ghost,))
        require(n_ghost == 0 or (ghosts.min() >= 0 and ghosts.max() < meta.num_nodes),
                "ghosts", f"global ids must be in [0, {meta.num_nodes})")
        ghost_offsets = load("ghost_offsets", np.int64, (p_count + 1,))
        check_offsets("ghost_offsets", ghost_offsets, n_ghost)
        indptr = load("indptr", np.int64, (n_owned + 1,))
        require(indptr[0] == 0 and indptr[-1] == nnz and bool(np.all(np.diff(indptr) >= 1)),
                "indptr", f"must rise from 0 to nnz {nnz}, by at least 1 (the self loop) a row")
        indices = load("indices", vertex_dtype(n_local), (nnz,))
        require(nnz == 0 or (indices.min() >= 0 and indices.max() < n_local),
                "indices", f"local ids must be in [0, {n_local})")
        norm = load("norm", np.float32, (n_local,))
        require(bool(np.all((norm > 0) & (norm <= 1))), "norm", "entries must be (1 + degree)^-1/2, in (0, 1]")
        if meta.feature_layout(i) == "csr":
            k, width = expect["features_nnz"], meta.num_features
            data = load("features_data", np.float32, (k,))
            columns = load("features_indices", index_dtype(width), (k,))
            rows = load("features_indptr", np.int64, (n_owned + 1,))
            require(rows[0] == 0 and rows[-1] == k and bool(np.all(np.diff(rows) >= 0)),
                    "features_indptr", f"must rise from 0 to features_nnz {k}")
            require(k == 0 or (columns.min() >= 0 and columns.max() < width),
                    "features_indices", f"columns must be in [0, {width})")
            try:
                features = SparseRows(data, columns, rows, (n_owned, width))
            except ValueError as exc:  # e.g. columns not ascending within a row
                raise StoreError(f"partition store {self.path}: {part_file(i, 'features_indices')}: {exc}") from None
        else:
            features = load("features", np.float32, (n_owned, meta.num_features))
        labels = load("labels", np.int64, (n_owned,))
        masks = {name: load(name, np.bool_, (n_owned,)) for name in MASK_NAMES}
        send_offsets = load("send_offsets", np.int64, (p_count + 1,))
        send_indices = load("send_indices", np.int64, (int(send_offsets[-1]),))
        check_offsets("send_offsets", send_offsets, send_indices.shape[0])
        require(send_indices.size == 0 or (send_indices.min() >= 0 and send_indices.max() < n_owned),
                "send_indices", f"local ids must be owned, in [0, {n_owned})")
        return Partition(
            part_id=i, num_parts=p_count, owned=owned, ghosts=ghosts, ghost_offsets=ghost_offsets,
            indptr=indptr, indices=indices, norm=norm, features=features, labels=labels,
            **masks, send_indices=send_indices, send_offsets=send_offsets, undirected=not meta.directed,
        )


def open_dir(path: str | os.PathLike, verify: bool = True, *, parts: Iterable[int] | None = None) -> PartitionStore:
    """Open a partition store directory: parse and check ``meta.json`` (format version, keys,
    file list) and, with ``verify=True``, the sha256 of every file (a few seconds per GB), or
    of ``parts`` only. With ``verify=False`` call :meth:`PartitionStore.verify` for the parts
    you load. :func:`dorylus.partition.open_store` opens an ``s3://`` URL too."""
    parts = None if parts is None else list(parts)
    root = Path(path)
    meta_path = root / META_FILE
    if not meta_path.is_file():
        what = "does not exist" if not root.exists() else f"has no {META_FILE} (not a partition store?)"
        raise StoreError(f"partition store {root} {what}")
    try:
        text = meta_path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise StoreError(f"{meta_path}: cannot read ({exc})") from None
    store = PartitionStore(root, StoreMeta.from_json(text, str(meta_path)))
    if verify:
        store.verify(parts)
    return store


class _HashingWriter:
    """File wrapper that hashes what ``np.save`` writes through it (one pass over the data)."""

    def __init__(self, f):
        self._f = f
        self.digest = hashlib.sha256()

    def write(self, data) -> int:
        self.digest.update(data)
        return self._f.write(data)


def _check_assignment(parts: np.ndarray, num_nodes: int) -> tuple[np.ndarray, int]:
    parts = np.asarray(parts)
    if parts.shape != (num_nodes,) or not np.issubdtype(parts.dtype, np.integer):
        raise ConfigError(f"part assignment must be integers of shape ({num_nodes},), got {parts.dtype} {parts.shape}")
    if parts.min() < 0:
        raise ConfigError(f"part assignment has negative part id {int(parts.min())}")
    num_parts = int(parts.max()) + 1
    empty = np.flatnonzero(np.bincount(parts, minlength=num_parts) == 0)
    if empty.size:
        raise ConfigError(f"part assignment leaves part {int(empty[0])} of {num_parts} empty")
    return parts, num_parts


def check_store_target(out: Path, overwrite: bool) -> None:
    """Refuse to replace anything but an empty directory or (with ``overwrite``) a store, and a
    path that cannot be created (under a regular file, in a read-only directory)."""
    out = Path(out)
    if not (out.exists() or out.is_symlink()):
        try:
            check_creatable_dir(out, "partition store")
        except ConfigError as exc:
            raise StoreError(str(exc)) from None
        return
    if not out.is_dir():
        raise StoreError(f"cannot write partition store to {out}: it exists and is not a directory")
    if not any(out.iterdir()):
        return
    if not overwrite:
        raise StoreError(f"refusing to overwrite non-empty directory {out} (--overwrite, or overwrite=True, replaces a partition store)")
    if not (out / META_FILE).is_file():
        raise StoreError(f"refusing to replace {out}: it is not a partition store (no {META_FILE})")


# ----------------------------------------------------------------------------- vertex order


def locality_order(indptr: np.ndarray, indices: np.ndarray, method: str, seed: int = 0) -> np.ndarray:
    """``int64 [n]``: a numbering of the ``n`` rows of a graph's CSR (``indices`` in ``[0, n)``,
    no self loops, read as undirected) such that neighbours get near numbers: ``order[k]`` is
    the vertex numbered ``k``.

    ``community``: communities found by label propagation (random visits drawn from ``seed``),
    each in reverse Cuthill-McKee order (:func:`dorylus.models.kernels.community_order`).
    ``rcm``: reverse Cuthill-McKee (:func:`dorylus.models.kernels.locality_order`). ``bfs``:
    breadth-first, level by level (a few numpy passes per level), each component from a
    least-degree vertex, a level's vertices in the order of their first parent, then by id;
    rows without neighbours last. ``none``: the identity.
    """
    n = int(indptr.shape[0] - 1)
    if method == "none" or n == 0:
        return np.arange(n, dtype=np.int64)
    if method in ("community", "rcm"):
        from dorylus.models import kernels

        if method == "community":
            return kernels.community_order(indptr, indices, seed=seed)
        return kernels.locality_order(indptr, indices)
    if method != "bfs":
        raise ConfigError(f"vertex_order must be one of {', '.join(VERTEX_ORDERS)}, got {method!r}")
    degree = np.diff(indptr)
    visited = degree == 0  # isolated rows are placed last, in id order
    order = np.empty(n, dtype=np.int64)
    filled = 0
    seeds = np.argsort(degree, kind="stable")
    next_seed = int(np.count_nonzero(visited))  # seeds[:k] are the isolated rows
    connected = n - next_seed
    while filled < connected:
        while visited[seeds[next_seed]]:
            next_seed += 1
        frontier = seeds[next_seed:next_seed + 1].astype(np.int64)
        visited[frontier] = True
        order[filled] = frontier[0]
        filled += 1
        while frontier.size:
            counts = degree[frontier]
            offsets = np.repeat(indptr[frontier] - (np.cumsum(counts) - counts), counts)
            neighbours = indices[offsets + np.arange(int(counts.sum()), dtype=np.int64)].astype(np.int64)
            parent = np.repeat(np.arange(frontier.size, dtype=np.int64), counts)
            fresh = ~visited[neighbours]
            neighbours, parent = neighbours[fresh], parent[fresh]
            neighbours = neighbours[np.lexsort((neighbours, parent))]
            # each vertex at its first occurrence (its first parent's place)
            by_id = np.argsort(neighbours, kind="stable")
            first = np.ones(by_id.size, dtype=bool)
            first[1:] = neighbours[by_id[1:]] != neighbours[by_id[:-1]]
            frontier = neighbours[np.sort(by_id[first])]
            visited[frontier] = True
            order[filled:filled + frontier.size] = frontier
            filled += frontier.size
    order[filled:] = np.flatnonzero(degree == 0)
    return order


# ----------------------------------------------------------------------------- writing


class StoreWriter:
    """Writes a partition store part by part, never holding the whole graph.

    Use as a context manager: parts are written into a temp directory next to ``out_dir``;
    :meth:`finish` (called on a clean exit if not before) writes the send lists and
    ``meta.json`` and installs the store atomically; an exception removes the temp directory.
    Memory: one part's arrays at a time plus an ``int32 [N]`` global-to-local map and the ghost
    lists (a few bytes per replicated vertex).

    Args:
        out_dir: target; must not exist or be empty, unless ``overwrite`` and it is a store.
        num_parts, num_nodes, num_features, num_classes: ``P``, ``N``, ``F``, ``C``.
        dataset_name, directed, method, seed: recorded in ``meta.json``.
        sparse_features: ``auto`` (a part's features as CSR when under 10% non-zero), ``on``, ``off``.
        vertex_order: ``community`` (default), ``rcm``, ``bfs`` or ``none`` (:func:`locality_order`
            of each part's owned vertices).
        num_edges: recorded as ``num_edges`` (default: the in-edges written, self loops excluded).
        progress: called with one line per part.
    """

    def __init__(self, out_dir: str | os.PathLike, *, num_parts: int, num_nodes: int, num_features: int,
                 num_classes: int, dataset_name: str, directed: bool, method: str, seed: int,
                 overwrite: bool = False, sparse_features: str = "auto", vertex_order: str = "community",
                 num_edges: int | None = None, progress: Callable[[str], None] | None = None):
        if sparse_features not in SPARSE_MODES:
            raise ConfigError(f"sparse_features must be one of {', '.join(SPARSE_MODES)}, got {sparse_features!r}")
        if vertex_order not in VERTEX_ORDERS:
            raise ConfigError(f"vertex_order must be one of {', '.join(VERTEX_ORDERS)}, got {vertex_order!r}")
        if not (num_parts >= 1 and num_nodes >= num_parts and num_features >= 0 and num_classes >= 1):
            raise ConfigError(f"a store needs num_parts >= 1, num_nodes >= num_parts, num_classes >= 1; got "
                              f"{num_parts}, {num_nodes}, {num_classes}")
        self.out, self.overwrite = Path(out_dir), overwrite
        self.num_parts, self.num_nodes, self.num_features = int(num_parts), int(num_nodes), int(num_features)
        self.num_classes, self.dataset_name, self.directed = int(num_classes), dataset_name, bool(directed)
        self.method, self.seed, self.sparse_features, self.vertex_order = method, int(seed), sparse_features, vertex_order
        self.num_edges, self.say = num_edges, progress or (lambda message: None)
        self.tmp: Path | None = None
        self.meta: StoreMeta | None = None
        self._hashes: dict[str, str] = {}
        self._entries: list[dict | None] = [None] * self.num_parts
        self._ghosts: list[tuple[np.ndarray, np.ndarray] | None] = [None] * self.num_parts
        self._counts = np.zeros(len(MASK_NAMES), dtype=np.int64)
        self._local_of: np.ndarray | None = None

    def __enter__(self) -> "StoreWriter":
        check_store_target(self.out, self.overwrite)
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = atomic.temp_dir_beside(self.out, mode=0o700)
        return self

    def __exit__(self, kind, exc, tb) -> None:
        try:
            if kind is None and self.meta is None:
                self.finish()
        finally:
            if self.tmp is not None and self.tmp.exists():
                shutil.rmtree(self.tmp, ignore_errors=True)

    def _save(self, i: int, name: str, array: np.ndarray) -> None:
        rel = part_file(i, name)
        with open(self.tmp / rel, "wb") as f:
            writer = _HashingWriter(f)
            np.save(writer, np.ascontiguousarray(array), allow_pickle=False)
        self._hashes[rel] = writer.digest.hexdigest()

    def write_part(self, i: int, owned: np.ndarray, src: np.ndarray, dst: np.ndarray, degree: np.ndarray,
                   part_of: np.ndarray, features: np.ndarray, labels: np.ndarray, train_mask: np.ndarray,
                   val_mask: np.ndarray, test_mask: np.ndarray) -> None:
        """Write part ``i``.

        Args:
            owned: ``int [n_i]`` global ids of the part's vertices (any order: the writer numbers them).
            src, dst: ``int32/int64 [e_i]`` global ids of the part's in-edges ``src -> dst``: every
                ``dst`` owned by part ``i``, no self loops, already symmetrized for an undirected
                graph (a duplicate counts once).
            degree: ``int [N]`` global in-degree without the self loop (the writer adds it);
                the owned rows' must equal their distinct in-edges here.
            part_of: ``int [N]`` part of every vertex.
            features: ``float32 [n_i, F]``; labels ``int64 [n_i]``; masks ``bool [n_i]``: rows of
                ``owned``, in its order.
        """
        if self.tmp is None:
            raise RuntimeError("StoreWriter.write_part outside its with block")
        n, p_count = self.num_nodes, self.num_parts
        if not 0 <= i < p_count or self._entries[i] is not None:
            raise ConfigError(f"part {i} is not a part still to write (0..{p_count - 1})")
        owned = np.asarray(owned, dtype=np.int64)
        src, dst, degree, part_of = (np.asarray(a) for a in (src, dst, degree, part_of))
        n_own = owned.shape[0]
        for name, array, shape in (("owned", owned, (n_own,)), ("src", src, dst.shape), ("dst", dst, src.shape),
                                   ("degree", degree, (n,)), ("part_of", part_of, (n,))):
            if array.ndim != 1 or array.shape != shape or not np.issubdtype(array.dtype, np.integer):
                raise ConfigError(f"part {i}: {name} must be a 1-D integer array of shape {shape}, "
                                  f"got {array.dtype} {array.shape}")
        if n_own == 0 or owned.min() < 0 or owned.max() >= n or np.any(part_of[owned] != i):
            raise ConfigError(f"part {i}: owned must be non-empty global ids in [0, {n}) of vertices with part_of == {i}")
        if src.size and (min(src.min(), dst.min()) < 0 or max(src.max(), dst.max()) >= n):
            raise ConfigError(f"part {i}: src and dst must be global ids in [0, {n})")
        if src.size and (np.any(part_of[dst] != i) or np.any(src == dst)):
            raise ConfigError(f"part {i}: every in-edge needs an owned dst and no self loop")
        rows = {"features": np.asarray(features), "labels": np.asarray(labels),
                **{name: np.asarray(m) for name, m in zip(MASK_NAMES, (train_mask, val_mask, test_mask))}}
        for name, array in rows.items():
            shape = (n_own, self.num_features) if name == "features" else (n_own,)
            if array.shape != shape:
                raise ConfigError(f"part {i}: {name} must have shape {shape} (rows of owned), got {array.shape}")
        if self._local_of is None:
            self._local_of = np.empty(n, dtype=vertex_dtype(n))
        local_of = self._local_of  # global -> local id; only this part's entries are read

        # Owned vertices in locality order, computed on the part's internal edges.
        local_of[owned] = np.arange(n_own)
        if not np.array_equal(local_of[owned], np.arange(n_own)):
            raise ConfigError(f"part {i}: owned lists a vertex twice")
        internal = part_of[src] == i
        keys = local_of[dst[internal]].astype(np.int64) * n_own + local_of[src[internal]]
        keys.sort()
        inner_indptr = np.searchsorted(keys, np.arange(n_own + 1, dtype=np.int64) * n_own)
        np.remainder(keys, n_own, out=keys)
        order = locality_order(inner_indptr, keys, self.vertex_order, self.seed)
        del keys, inner_indptr
        owned = owned[order]
        local_of[owned] = np.arange(n_own)

        # Ghosts by owning part, then by the first (least) row that reads them: the exchange
        # copies whole blocks, and Gather meets each ghost near its first reader.
        remote = ~internal
        del internal
        keys = src[remote].astype(np.int64) * n_own + local_of[dst[remote]]
        del remote
        keys.sort()
        first = np.ones(keys.shape[0], dtype=bool)
        ids = keys // n_own
        first[1:] = ids[1:] != ids[:-1]
        ids, first_row = ids[first], keys[first] % n_own
        del keys, first
        ids = ids[np.lexsort((ids, first_row, part_of[ids]))]
        ghost_offsets = np.zeros(p_count + 1, dtype=np.int64)
        np.cumsum(np.bincount(part_of[ids], minlength=p_count), out=ghost_offsets[1:])
        ghosts, n_local = ids, n_own + ids.shape[0]
        local_of[ghosts] = n_own + np.arange(ghosts.shape[0])

        # The pattern of A + I on the owned rows, columns ascending (local ids) within a row.
        keys = np.empty(src.shape[0] + n_own, dtype=np.int64)
        keys[:src.shape[0]] = local_of[dst]
        keys[:src.shape[0]] *= n_local
        keys[:src.shape[0]] += local_of[src]
        keys[src.shape[0]:] = np.arange(n_own, dtype=np.int64) * (n_local + 1)
        keys.sort()
        distinct = np.ones(keys.shape[0], dtype=bool)
        np.not_equal(keys[1:], keys[:-1], out=distinct[1:])
        if not distinct.all():
            keys = keys[distinct]
        del distinct
        indptr = np.searchsorted(keys, np.arange(n_own + 1, dtype=np.int64) * n_local).astype(np.int64)
        np.remainder(keys, n_local, out=keys)
        indices = keys.astype(vertex_dtype(n_local))
        del keys
        if not np.array_equal(np.diff(indptr) - 1, degree[owned]):
            v = int(owned[np.flatnonzero(np.diff(indptr) - 1 != degree[owned])[0]])
            raise ConfigError(f"part {i}: degree[{v}] is {int(degree[v])} but the part has "
                              f"{int(np.diff(indptr)[local_of[v]] - 1)} distinct in-edges of it")

        (self.tmp / f"part-{i}").mkdir()
        norm = gcn_norm(np.concatenate([degree[owned], degree[ghosts]]))
        for name, array in (("owned", owned), ("ghosts", ghosts), ("ghost_offsets", ghost_offsets),
                            ("indptr", indptr), ("indices", indices), ("norm", norm),
                            ("labels", rows["labels"][order].astype(np.int64, copy=False)),
                            *((m, rows[m][order].astype(bool, copy=False)) for m in MASK_NAMES)):
            self._save(i, name, array)
        self._counts += [int(np.count_nonzero(rows[m])) for m in MASK_NAMES]
        entry = {"num_owned": int(n_own), "num_ghosts": int(ghosts.shape[0]), "nnz": int(indptr[-1])}
        x = rows["features"]
        if use_sparse(self.sparse_features, density(x)):
            sparse = SparseRows.from_dense(np.asarray(x[order], dtype=np.float32))
            for name, array in zip(FEATURE_FILES["csr"], (sparse.data, sparse.indices, sparse.indptr)):
                self._save(i, name, array)
            entry.update(features="csr", features_nnz=sparse.nnz)
        else:
            self._save(i, "features", np.asarray(x[order], dtype=np.float32))
            entry.update(features="dense")
        self._entries[i] = entry
        self._ghosts[i] = (ghosts, ghost_offsets)
        self.say(f"part {i + 1}/{p_count}: {n_own} vertices, {ghosts.shape[0]} ghosts, {int(indptr[-1])} in-edges "
                 f"(vertex order {self.vertex_order})")

    def finish(self) -> StoreMeta:
        """Write the send lists and ``meta.json`` and install the store; returns its meta."""
        if self.meta is not None:
            return self.meta
        missing = [i for i, entry in enumerate(self._entries) if entry is None]
        if missing:
            raise ConfigError(f"partition store {self.out}: part {missing[0]} of {self.num_parts} was never written")
        # Part i sends to part j exactly j's ghost block for i, in that order, as i's local ids.
        for i in range(self.num_parts):
            owned = np.load(self.tmp / part_file(i, "owned"))
            by_id = np.argsort(owned)
            blocks = [ghosts[offsets[i]:offsets[i + 1]] for ghosts, offsets in self._ghosts]
            wanted = np.concatenate(blocks)
            pos = np.minimum(np.searchsorted(owned, wanted, sorter=by_id), max(owned.shape[0] - 1, 0))
            if not np.array_equal(owned[by_id[pos]], wanted):
                raise ConfigError(f"partition store {self.out}: another part holds ghosts that part {i} does not "
                                  "own (part_of differed between write_part calls)")
            send_offsets = np.zeros(self.num_parts + 1, dtype=np.int64)
            np.cumsum([b.shape[0] for b in blocks], out=send_offsets[1:])
            self._save(i, "send_indices", by_id[pos].astype(np.int64))
            self._save(i, "send_offsets", send_offsets)
        nnz = sum(e["nnz"] for e in self._entries)
        self.meta = StoreMeta(
            format_version=FORMAT_VERSION, dataset=self.dataset_name, num_nodes=self.num_nodes,
            num_edges=int(self.num_edges if self.num_edges is not None else nnz - self.num_nodes), nnz=nnz,
            num_features=self.num_features, num_classes=self.num_classes, directed=self.directed,
            symmetrized=not self.directed, normalization=NORMALIZATION, num_parts=self.num_parts,
            partitioner=self.method, seed=self.seed, vertex_order=self.vertex_order,
            **{f"{m.split('_')[0]}_count": int(c) for m, c in zip(MASK_NAMES, self._counts)},
            parts=list(self._entries), files=self._hashes, created_by=f"dorylus {__version__}",
        )
        if sum(e["num_owned"] for e in self._entries) != self.num_nodes:
            raise ConfigError(f"partition store {self.out}: the parts own {sum(e['num_owned'] for e in self._entries)} "
                              f"vertices, num_nodes is {self.num_nodes}")
        (self.tmp / META_FILE).write_text(self.meta.to_json())
        check_store_target(self.out, self.overwrite)  # again: another process may have written it meanwhile
        atomic.replace_dir(self.tmp, self.out)
        self.say(f"wrote partition store {self.out}: {self.num_parts} parts, {self.num_nodes} vertices, "
                 f"{nnz} A_hat entries")
        return self.meta


def part_edges(keys: np.ndarray, part_of: np.ndarray, part: int, num_nodes: int) -> tuple[np.ndarray, np.ndarray]:
    """``(src, dst)`` of the edge keys ``dst * N + src`` whose ``dst`` lies in ``part``, as int32
    when ``N`` allows, scanned in chunks so the temporaries stay a few MB."""
    dtype, n = vertex_dtype(num_nodes), np.int64(num_nodes)
    srcs, dsts = [], []
    for start in range(0, keys.shape[0], _EDGE_CHUNK):
        chunk = keys[start:start + _EDGE_CHUNK]
        dst = chunk // n
        mine = part_of[dst] == part
        srcs.append((chunk[mine] % n).astype(dtype))
        dsts.append(dst[mine].astype(dtype))
    empty = np.empty(0, dtype=dtype)
    return np.concatenate(srcs or [empty]), np.concatenate(dsts or [empty])


def write_store(
    dataset: GraphDataset,
    parts: np.ndarray,
    out_dir: str | os.PathLike,
    *,
    method: str,
    seed: int,
    overwrite: bool = False,
    progress: Callable[[str], None] | None = None,
    sparse_features: str = "auto",
    vertex_order: str = "community",
) -> StoreMeta:
    """Write ``dataset`` split by ``parts`` as a partition store at ``out_dir`` (atomically),
    one part at a time through :class:`StoreWriter`.

    Holds the sorted distinct edge keys (8 bytes per stored in-edge) and one part's arrays;
    never the normalized whole-graph ``A_hat`` (only the degrees are needed).

    Args:
        dataset: the whole graph; validated first.
        parts: ``int [N]`` part id per vertex; parts ``0..max`` must all be non-empty.
        out_dir: target directory; must not exist or be empty, unless ``overwrite`` and it is a
            partition store, which is then replaced only after the new one is complete.
        method, seed: recorded in ``meta.json``.
        progress: called with one human-readable line per step.
        sparse_features: ``auto`` (CSR when under 10% of the whole matrix is non-zero), ``on``
            (CSR) or ``off`` (dense): the layout of every part's features.
        vertex_order: ``community`` (default), ``rcm``, ``bfs`` or ``none``: the numbering of each
            part's vertices.

    Returns:
        The :class:`StoreMeta` written to ``meta.json``.
    """
    dataset.validate()
    try:
        layout = "on" if use_sparse(sparse_features, density(dataset.features)) else "off"
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    n = dataset.num_nodes
    parts, num_parts = _check_assignment(parts, n)
    say = progress or (lambda message: None)
    with StoreWriter(out_dir, num_parts=num_parts, num_nodes=n, num_features=dataset.num_features,
                     num_classes=dataset.num_classes, dataset_name=dataset.name, directed=dataset.directed,
                     method=method, seed=seed, overwrite=overwrite, sparse_features=layout,
                     vertex_order=vertex_order, num_edges=dataset.num_edges, progress=say) as writer:
        keys = edge_keys(dataset.src, dataset.dst, n, symmetrize=not dataset.directed)
        degree = np.diff(np.searchsorted(keys, np.arange(n + 1, dtype=np.int64) * n))
        say(f"{keys.shape[0]} distinct in-edges of {n} vertices")
        for i in range(num_parts):
            owned = np.flatnonzero(parts == i)
            src, dst = part_edges(keys, parts, i, n)
            writer.write_part(i, owned, src, dst, degree, parts, dataset.features[owned], dataset.labels[owned],
                              *(getattr(dataset, m)[owned] for m in MASK_NAMES))
            del src, dst
        del keys
        return writer.finish()


def reassemble(store: PartitionStore) -> tuple[GraphDataset, NormalizedAdjacency]:
    """Rebuild the global dataset and ``A_hat`` from the parts (the inverse of :func:`write_store`,
    whatever the vertex order).

    The dataset's edges are ``A_hat``'s off-diagonal entries (already symmetrized for an
    undirected graph, which normalizing again leaves unchanged). Raises :class:`StoreError` if
    the parts do not own every vertex exactly once.
    """
    meta = store.meta
    n = meta.num_nodes
    loaded = [store.load_part(i, mmap=True) for i in range(meta.num_parts)]
    owners = np.bincount(np.concatenate([p.owned for p in loaded]), minlength=n)
    if np.any(owners != 1):
        v = int(np.flatnonzero(owners != 1)[0])
        raise StoreError(f"partition store {store.path}: vertex {v} is owned by {int(owners[v])} parts")
    keys = np.concatenate([p.owned[np.repeat(np.arange(p.n_owned), np.diff(p.indptr))] * np.int64(n)
                           + p.global_ids()[p.indices] for p in loaded])
    keys.sort()
    indptr = np.searchsorted(keys, np.arange(n + 1, dtype=np.int64) * n).astype(np.int64)
    indices = (keys % n).astype(vertex_dtype(n))
    norm = np.empty(n, dtype=np.float32)
    features = np.empty((n, meta.num_features), dtype=np.float32)
    labels = np.empty(n, dtype=np.int64)
    masks = {name: np.empty(n, dtype=bool) for name in MASK_NAMES}
    for p in loaded:
        norm[p.owned] = p.norm[:p.n_owned]
        features[p.owned] = p.features.toarray() if isinstance(p.features, SparseRows) else p.features
        labels[p.owned] = p.labels
        for name in MASK_NAMES:
            masks[name][p.owned] = getattr(p, name)
    adj = NormalizedAdjacency(indptr=indptr, indices=indices, norm=norm, in_degree=np.diff(indptr) - 1)
    rows = adj.rows()
    off_diagonal = rows != indices
    dataset = GraphDataset(
        name=meta.dataset, src=indices[off_diagonal].astype(np.int64), dst=rows[off_diagonal], features=features,
        labels=labels, **masks, num_classes=meta.num_classes, directed=meta.directed,
    )
    return dataset, adj
