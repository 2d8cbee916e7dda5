r"""The partition store (DESIGN §6): a partitioned dataset as a directory of ``.npy`` files.

Layout, for ``P`` parts of a graph with ``N`` vertices::

    meta.json            format version, dataset, global counts, partitioner, per-file sha256
    part-<i>/owned.npy          int64 [n_owned]      global ids owned by part i, ascending
    part-<i>/ghosts.npy         int64 [n_ghost]      remote in-neighbours of owned vertices,
                                                     by owning part, then global id, ascending
    part-<i>/ghost_offsets.npy  int64 [P + 1]        ghosts[o[j]:o[j+1]] are owned by part j
    part-<i>/indptr.npy         int64 [n_owned + 1]  CSR of in-edges of owned vertices ...
    part-<i>/indices.npy        int64 [nnz_i]        ... source in *local* ids ...
    part-<i>/weights.npy        float32 [nnz_i]      ... and the global A_hat entry (bitwise)
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

Local ids: ``k < n_owned`` is ``owned[k]``; ``n_owned + g`` is ``ghosts[g]``. Within a CSR row,
entries keep the global order (ascending global source id). ``A_hat`` is normalized once on the
whole graph, so partition ``i``'s Gather ``Z[v] = sum_u A_hat[v, u] H[u]`` over local rows
equals the global one. Part ``i``'s send block for ``j`` lists, in the same order, the vertices
of part ``j``'s ghost block for ``i``: ghost exchange is a plain row copy.

Features are stored sparse when :func:`dorylus.models.sparse.use_sparse` says so for the whole
matrix's density and ``sparse_features`` (``auto``: below 10% non-zeros, as bag-of-words). A
part's entry in ``meta.json`` records its layout (``"features": "dense" | "csr"``, with
``features_nnz`` for CSR). ``format_version`` is the oldest reader that can read the store:
1 when every part is dense (the entries then carry no layout, as before sparse features), 2
when any part is CSR. Both are read.

Writing is atomic: everything goes to a temp directory next to the target, which is renamed
into place only when complete. Verification of sha256 checksums happens in :func:`open_store`
(all parts, ``verify=True``) or per part with :meth:`PartitionStore.verify`; :meth:`load_part`
always checks presence, dtypes, shapes and index ranges (cheap relative to training).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import uuid
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Callable, Iterable

import numpy as np

from dorylus import __version__
from dorylus.data.graph import MASK_NAMES, GraphDataset
from dorylus.errors import ConfigError, StoreError
from dorylus.models.sparse import SparseRows, density, index_dtype, use_sparse
from dorylus.normalize import NormalizedAdjacency, gcn_normalize
from dorylus.normalize import sorted_unique
from dorylus.runs import check_creatable_dir

FORMAT_VERSION = 2       # written when a part's features are CSR
DENSE_FORMAT_VERSION = 1  # written when every part is dense: older readers can still read it
READ_VERSIONS = (1, 2)
NORMALIZATION = "gcn-sym-selfloop"
META_FILE = "meta.json"
# The files of a part: these, and the features' files of its layout.
GRAPH_FILES = (
    "owned", "ghosts", "ghost_offsets", "indptr", "indices", "weights",
    "labels", *MASK_NAMES, "send_indices", "send_offsets",
)
FEATURE_FILES = {"dense": ("features",), "csr": ("features_data", "features_indices", "features_indptr")}
_HASH_CHUNK = 8 << 20


def part_file(part: int, name: str) -> str:
    """Path of one array file relative to the store root, as listed in ``meta.json``."""
    return f"part-{part}/{name}.npy"


@dataclass
class StoreMeta:
    """The contents of ``meta.json``. ``parts[i]`` holds ``num_owned``, ``num_ghosts`` and
    ``nnz`` of part ``i``; ``files`` maps each relative file path to its sha256 (hex)."""

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
            raise StoreError(
                f"partition store {store} has format version {version}; this dorylus reads "
                f"{', '.join(map(str, READ_VERSIONS))}"
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
        if meta.num_parts < 1 or len(meta.parts) != meta.num_parts:
            raise StoreError(f"{where}: 'parts' has {len(meta.parts)} entries for num_parts {meta.num_parts}")
        for i, entry in enumerate(meta.parts):
            if not isinstance(entry, dict) or not all(
                isinstance(entry.get(k), int) and entry[k] >= 0 for k in ("num_owned", "num_ghosts", "nnz")
            ):
                raise StoreError(f"{where}: parts[{i}] needs non-negative integers num_owned, num_ghosts, nnz")
            layout = entry.get("features", "dense" if meta.format_version == 1 else None)
            if layout not in FEATURE_FILES or (meta.format_version == 1 and "features" in entry):
                raise StoreError(f"{where}: parts[{i}] 'features' must be one of {', '.join(FEATURE_FILES)} "
                                 f"(format version 2; version 1 stores are dense), got {entry.get('features')!r}")
            nnz = entry.get("features_nnz")
            if layout == "csr" and (not isinstance(nnz, int) or isinstance(nnz, bool) or nnz < 0):
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
        return self.parts[part].get("features", "dense")

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
    weights: np.ndarray
    features: np.ndarray | SparseRows
    labels: np.ndarray
    train_mask: np.ndarray
    val_mask: np.ndarray
    test_mask: np.ndarray
    send_indices: np.ndarray
    send_offsets: np.ndarray

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
    """An opened partition store: ``meta`` plus per-part loading. Create with :func:`open_store`."""

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
        the file). ``mmap=True`` maps the files read-only instead of reading them."""
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
        owned = load("owned", np.int64, (n_owned,))
        require(n_owned == 0 or (owned[0] >= 0 and owned[-1] < meta.num_nodes and bool(np.all(np.diff(owned) > 0))),
                "owned", f"global ids must be ascending and in [0, {meta.num_nodes})")
        ghosts = load("ghosts", np.int64, (n_ghost,))
        require(n_ghost == 0 or (ghosts.min() >= 0 and ghosts.max() < meta.num_nodes),
                "ghosts", f"global ids must be in [0, {meta.num_nodes})")
        ghost_offsets = load("ghost_offsets", np.int64, (p_count + 1,))
        check_offsets("ghost_offsets", ghost_offsets, n_ghost)
        indptr = load("indptr", np.int64, (n_owned + 1,))
        require(indptr[0] == 0 and indptr[-1] == nnz and bool(np.all(np.diff(indptr) >= 0)),
                "indptr", f"must rise from 0 to nnz {nnz}")
        indices = load("indices", np.int64, (nnz,))
        require(nnz == 0 or (indices.min() >= 0 and indices.max() < n_owned + n_ghost),
                "indices", f"local ids must be in [0, {n_owned + n_ghost})")
        weights = load("weights", np.float32, (nnz,))
        require(bool(np.all(np.isfinite(weights))), "weights", "contains NaN or inf")
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
            indptr=indptr, indices=indices, weights=weights, features=features, labels=labels,
            **masks, send_indices=send_indices, send_offsets=send_offsets,
        )


def open_store(path: str | os.PathLike, verify: bool = True, *, parts: Iterable[int] | None = None) -> PartitionStore:
    """Open a partition store directory: parse and check ``meta.json`` (format version, keys,
    file list) and, with ``verify=True``, the sha256 of every file (a few seconds per GB), or
    of ``parts`` only. With ``verify=False`` call :meth:`PartitionStore.verify` for the parts
    you load. ``path`` may be ``s3://BUCKET/PREFIX``: the store (``parts`` only, default all)
    is then fetched into the local cache first (:mod:`dorylus.partition.s3`)."""
    parts = None if parts is None else list(parts)
    if isinstance(path, str) and path.startswith("s3://"):
        from dorylus.partition.s3 import fetch_store

        path = fetch_store(path, parts=parts)
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
    parts = parts.astype(np.int64, copy=False)
    num_parts = int(parts.max()) + 1
    empty = np.flatnonzero(np.bincount(parts, minlength=num_parts) == 0)
    if empty.size:
        raise ConfigError(f"part assignment leaves part {int(empty[0])} of {num_parts} empty")
    return parts, num_parts


def check_store_target(out: Path, overwrite: bool) -> None:
    """Refuse to replace anything but an empty directory or (with ``overwrite``) a store, and a
    path that cannot be created (under a regular file, in a read-only directory)."""
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


def _install(tmp: Path, out: Path, overwrite: bool) -> None:
    """Rename the complete ``tmp`` to ``out``; an old store is moved aside first, then deleted."""
    check_store_target(out, overwrite)
    if not out.exists():
        os.rename(tmp, out)
        return
    if not any(out.iterdir()):
        os.rmdir(out)
        os.rename(tmp, out)
        return
    old = out.with_name(f".{out.name}.old-{uuid.uuid4().hex[:8]}")
    os.rename(out, old)
    try:
        os.rename(tmp, out)
    except BaseException:
        os.rename(old, out)
        raise
    shutil.rmtree(old, ignore_errors=True)


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
) -> StoreMeta:
    """Write ``dataset`` split by ``parts`` as a partition store at ``out_dir`` (atomically).

    Args:
        dataset: the whole graph; validated (and its dtypes made canonical) first.
        parts: ``int [N]`` part id per vertex; parts ``0..max`` must all be non-empty.
        out_dir: target directory; must not exist or be empty, unless ``overwrite`` and it is a
            partition store, which is then replaced only after the new one is complete.
        method, seed: recorded in ``meta.json``.
        progress: called with one human-readable line per step.
        sparse_features: ``auto`` (CSR when under 10% of the features are non-zero), ``on``
            (CSR) or ``off`` (dense): the layout of every part's features.

    Returns:
        The :class:`StoreMeta` written to ``meta.json``.
    """
    out = Path(out_dir)
    dataset.validate()
    try:
        sparse = use_sparse(sparse_features, density(dataset.features))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    n = dataset.num_nodes
    parts, num_parts = _check_assignment(parts, n)
    check_store_target(out, overwrite)
    say = progress or (lambda message: None)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        meta = _write_parts(dataset, parts, num_parts, tmp, method, seed, say, sparse)
        (tmp / META_FILE).write_text(meta.to_json())
        _install(tmp, out, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    say(f"wrote partition store {out}: {num_parts} parts, {n} vertices, {meta.nnz} A_hat entries")
    return meta


def _write_parts(dataset: GraphDataset, parts: np.ndarray, num_parts: int, root: Path,
                 method: str, seed: int, say: Callable[[str], None], sparse: bool) -> StoreMeta:
    n = dataset.num_nodes
    adj = gcn_normalize(dataset.src, dataset.dst, n, symmetrize=not dataset.directed)
    say(f"normalized A_hat on the whole graph: {n} vertices, {adj.nnz} entries (with self-loops)")
    hashes: dict[str, str] = {}

    def save(i: int, name: str, array: np.ndarray) -> None:
        rel = part_file(i, name)
        with open(root / rel, "wb") as f:
            writer = _HashingWriter(f)
            np.save(writer, array, allow_pickle=False)
        hashes[rel] = writer.digest.hexdigest()

    owned_by_part = [np.flatnonzero(parts == i) for i in range(num_parts)]
    ghost_blocks: list[tuple[np.ndarray, np.ndarray]] = []
    part_meta = []
    local_of = np.empty(n, dtype=np.int64)  # global -> local id; only entries of part i are read
    part_bounds = np.arange(num_parts + 1, dtype=np.int64) * n
    for i, owned in enumerate(owned_by_part):
        (root / f"part-{i}").mkdir()
        starts = adj.indptr[owned]
        counts = adj.indptr[owned + 1] - starts
        indptr = np.zeros(owned.shape[0] + 1, dtype=np.int64)
        np.cumsum(counts, out=indptr[1:])
        # Position in the global CSR of each local entry: row k's entries start at starts[k].
        pos = np.repeat(starts - indptr[:-1], counts)
        pos += np.arange(pos.shape[0], dtype=np.int64)
        del starts, counts
        cols = adj.indices[pos]
        remote = cols[parts[cols] != i]
        ghost_keys = sorted_unique(parts[remote] * n + remote)  # sorted by (owning part, global id)
        del remote
        ghosts = ghost_keys % n
        ghost_offsets = np.searchsorted(ghost_keys, part_bounds).astype(np.int64)
        del ghost_keys
        local_of[owned] = np.arange(owned.shape[0], dtype=np.int64)
        local_of[ghosts] = owned.shape[0] + np.arange(ghosts.shape[0], dtype=np.int64)
        for name, array in (
            ("owned", owned), ("ghosts", ghosts), ("ghost_offsets", ghost_offsets), ("indptr", indptr),
            ("indices", local_of[cols]), ("weights", adj.weights[pos]), ("labels", dataset.labels[owned]),
            *((mask, getattr(dataset, mask)[owned]) for mask in MASK_NAMES),
        ):
            save(i, name, array)
        del cols, pos
        entry = {"num_owned": int(owned.shape[0]), "num_ghosts": int(ghosts.shape[0]), "nnz": int(indptr[-1])}
        if sparse:
            features = SparseRows.from_dense(dataset.features[owned])
            for name, array in zip(FEATURE_FILES["csr"], (features.data, features.indices, features.indptr)):
                save(i, name, array)
            entry.update(features="csr", features_nnz=features.nnz)
        else:
            save(i, "features", dataset.features[owned])
        ghost_blocks.append((ghosts, ghost_offsets))
        part_meta.append(entry)
        say(f"part {i + 1}/{num_parts}: {owned.shape[0]} vertices, {ghosts.shape[0]} ghosts, {int(indptr[-1])} in-edges")

    # Part i sends to part j exactly j's ghost block for i, in that order, as i's local ids.
    for i, owned in enumerate(owned_by_part):
        blocks = [ghosts[offsets[i]:offsets[i + 1]] for ghosts, offsets in ghost_blocks]
        send_offsets = np.zeros(num_parts + 1, dtype=np.int64)
        np.cumsum([b.shape[0] for b in blocks], out=send_offsets[1:])
        save(i, "send_indices", np.searchsorted(owned, np.concatenate(blocks)).astype(np.int64))
        save(i, "send_offsets", send_offsets)

    return StoreMeta(
        format_version=FORMAT_VERSION if sparse else DENSE_FORMAT_VERSION, dataset=dataset.name, num_nodes=n,
        num_edges=dataset.num_edges, nnz=adj.nnz, num_features=dataset.num_features, num_classes=dataset.num_classes,
        directed=bool(dataset.directed), symmetrized=not dataset.directed, normalization=NORMALIZATION,
        num_parts=num_parts, partitioner=method, seed=int(seed),
        train_count=int(dataset.train_mask.sum()), val_count=int(dataset.val_mask.sum()),
        test_count=int(dataset.test_mask.sum()), parts=part_meta, files=hashes,
        created_by=f"dorylus {__version__}",
    )


def reassemble(store: PartitionStore) -> tuple[GraphDataset, NormalizedAdjacency]:
    """Rebuild the global dataset and ``A_hat`` from the parts (the inverse of :func:`write_store`).

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
    row_len = np.zeros(n, dtype=np.int64)
    for p in loaded:
        row_len[p.owned] = np.diff(p.indptr)
    indptr = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(row_len, out=indptr[1:])
    indices = np.empty(int(indptr[-1]), dtype=np.int64)
    weights = np.empty(int(indptr[-1]), dtype=np.float32)
    features = np.empty((n, meta.num_features), dtype=np.float32)
    labels = np.empty(n, dtype=np.int64)
    masks = {name: np.empty(n, dtype=bool) for name in MASK_NAMES}
    for p in loaded:
        pos = np.repeat(indptr[p.owned] - p.indptr[:-1], np.diff(p.indptr)) + np.arange(p.nnz)
        indices[pos] = p.global_ids()[p.indices]
        weights[pos] = p.weights
        features[p.owned] = p.features.toarray() if isinstance(p.features, SparseRows) else p.features
        labels[p.owned] = p.labels
        for name in MASK_NAMES:
            masks[name][p.owned] = getattr(p, name)
    adj = NormalizedAdjacency(indptr=indptr, indices=indices, weights=weights, in_degree=row_len - 1)
    rows = adj.rows()
    off_diagonal = rows != indices
    dataset = GraphDataset(
        name=meta.dataset, src=indices[off_diagonal], dst=rows[off_diagonal], features=features,
        labels=labels, **masks, num_classes=meta.num_classes, directed=meta.directed,
    )
    return dataset, adj
