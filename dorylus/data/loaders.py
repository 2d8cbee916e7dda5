"""Dataset loaders: every on-disk or in-memory graph format Dorylus reads, turned into a
validated :class:`~dorylus.data.graph.GraphDataset`.

Notation: ``N`` vertices, ``E`` edges, ``F`` features per vertex, ``C`` classes. Vertex ids are
``0 .. N-1``. A label of ``-1`` marks an unlabeled vertex, which must be in no mask. Every loader
ends with ``GraphDataset.validate(where=<file or object>)``, so a bad dataset fails with one
:class:`~dorylus.errors.DatasetError` naming the file and the first problem (id out of range,
length mismatch, NaN/inf feature, label out of range, empty training mask, ...).

Data formats
============

Dorylus archive (``.npz``) -- :func:`load_npz`, :func:`save_npz`
    A NumPy ``.npz`` archive (compressed or not, read with ``allow_pickle=False``) holding:

    ===============  =============================  ==========================================
    key              dtype, shape                   meaning
    ===============  =============================  ==========================================
    ``src``          integer ``[E]``                edge ``k`` goes ``src[k] -> dst[k]``
    ``dst``          integer ``[E]``
    ``features``     float (or int/bool) ``[N, F]`` vertex features, all finite
    ``labels``       integer ``[N]``                class in ``[0, C)``, or ``-1`` = unlabeled
    ``train_mask``   bool (or 0/1) ``[N]``          training vertices (at least one)
    ``val_mask``     bool (or 0/1) ``[N]``          validation vertices
    ``test_mask``    bool (or 0/1) ``[N]``          test vertices
    ``num_classes``  integer scalar, optional       ``C``; default ``max(labels) + 1``
    ``directed``     bool scalar, optional          default ``False``: edges are undirected and
                                                    symmetrized before normalization
    ``name``         string scalar, optional        default: the file name without ``.npz``
    ===============  =============================  ==========================================

    Extra keys are ignored. :func:`save_npz` writes all ten keys (uncompressed unless asked),
    to a temporary file in the same directory that then replaces the target.

    Reading in chunks: a member stored without compression (``np.savez``, the default of
    :func:`save_npz`) is a plain ``.npy`` at a fixed offset of the zip, so it is memory-mapped
    (features) or read a slice at a time (edges, :func:`open_edge_stream`). A compressed member
    (``np.savez_compressed``) cannot be mapped: deflate has no random access. Its arrays are
    read one at a time, and :func:`open_edge_stream` decompresses its edges sequentially, a
    chunk at a time, on every pass.

Edge list (``.edges``, ``.txt``, ``.tsv``, ``.csv``) -- :func:`load_edgelist`
    A text file with one edge ``src dst`` per line: two integer vertex ids separated by
    whitespace and/or commas (a comma counts as whitespace). ``#`` starts a comment that runs to
    the end of the line; blank lines are skipped. Any other line, a header row included (comment
    it out with ``#``), is an error naming the file and line number. Edges are read as
    undirected unless ``directed=True``. Beside ``X.edges`` (or ``X.txt``, ``X.tsv``, ``X.csv``):

    * ``X.features.npy``: float ``[N, F]``, required; its row count defines ``N``.
    * ``X.labels.npy``: integer ``[N]``, required; ``-1`` = unlabeled.
    * ``X.split.npz``: optional, with bool ``[N]`` arrays ``train_mask``, ``val_mask``,
      ``test_mask``. Without it the labeled vertices are shuffled with a seeded generator
      (``numpy.random.default_rng(seed)``, ``seed=0`` by default) and cut 60% / 20% / 20%
      into train / val / test (:data:`DEFAULT_SPLIT_FRACTIONS`; at least one training vertex).

    Other paths for these three files can be passed explicitly.

OGB node-property directory -- :func:`load_ogb`
    A dataset directory as the ``ogb`` package downloads it (e.g. ``ogbn_arxiv/``), parsed
    without that package. All files are gzip-compressed CSV without a header row:

    * ``raw/edge.csv.gz``: ``E`` rows ``src,dst``.
    * ``raw/node-feat.csv.gz``: ``N`` rows of ``F`` comma-separated floats.
    * ``raw/node-label.csv.gz``: ``N`` rows of one label; ``nan`` (unlabeled) becomes ``-1``.
      Multi-column (multi-task) labels are not supported.
    * ``raw/num-node-list.csv.gz``: optional, one row ``N``; must match the feature rows.
    * ``split/<scheme>/train.csv.gz``, ``valid.csv.gz``, ``test.csv.gz``: one vertex id per
      row. ``<scheme>`` is any single directory name (``time``, ``sales_rank``, ...); with
      several, choose one with ``split=``.

    The path may be the dataset directory itself or a directory holding exactly one dataset
    directory. OGB lists some graphs' edges in one direction only (ogbn-products) and some as
    directed citations (ogbn-arxiv); both load as undirected (``directed=False``) unless
    ``directed=True`` is passed. Other files (``mapping/``, ``processed/``) are ignored.

Dataset directory -- :func:`load_dataset_dir`, :func:`open_edge_stream`
    What ``dorylus generate`` writes for the streamed presets
    (:func:`dorylus.data.synthetic.write_streamed`): ``meta.json`` (``"format":
    "dorylus-dataset"``, ``version`` 1, ``name``, ``num_nodes``, ``num_edges``,
    ``num_features``, ``num_classes``, ``directed``, ``symmetric``: every pair listed both ways,
    once, without self-loops) and one ``.npy`` per array: ``src``/``dst`` (``int32`` or
    ``int64 [E]``), ``features`` (``float32 [N, F]``), ``labels`` (integer ``[N]``),
    ``train_mask``/``val_mask``/``test_mask`` (``bool [N]``). Every array is memory-mapped;
    nothing is read until used.

In-memory graphs -- :func:`from_pyg`, :func:`from_dgl`
    A ``torch_geometric.data.Data`` with ``edge_index [2, E]``, ``x [N, F]``, ``y [N]`` (or
    ``[N, 1]``) and ``train_mask``/``val_mask``/``test_mask [N]``; or a homogeneous DGL graph
    with edges from ``graph.edges()`` and ``ndata`` entries ``feat``, ``label``,
    ``train_mask``, ``val_mask``, ``test_mask``. Float labels with NaN become ``-1``. Neither
    library is imported until one of these functions is called.

:func:`load_dataset` is the single entry point of the CLI: a spec is a preset name from
:mod:`dorylus.data.synthetic` (presets win; write ``./name`` for a path that collides with one),
or a path dispatched on its type (``.npz``, edge-list extension, OGB directory, dataset
directory). :func:`open_edge_stream` opens the same specs for the streaming partitioner: edges in
bounded chunks, vertex arrays memory-mapped where the format allows.
"""

from __future__ import annotations

import hashlib
import importlib
import io
import os
import json
import re
import warnings
import zipfile
import zlib
from pathlib import Path
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np

from dorylus import atomic
from dorylus.data.graph import MASK_NAMES, GraphDataset, check_features_form
from dorylus.errors import DatasetError

PathLike = str | os.PathLike

EDGELIST_SUFFIXES = (".edges", ".txt", ".tsv", ".csv")
DEFAULT_SPLIT_FRACTIONS = (0.6, 0.2, 0.2)  # train, val, test share of the labeled vertices
NPZ_REQUIRED = ("src", "dst", "features", "labels", *MASK_NAMES)
OGB_SPLIT_FILES = {
    "train_mask": "train.csv.gz", "val_mask": "valid.csv.gz", "test_mask": "test.csv.gz",
}
SUPPORTED_TYPES = (
    "a preset name, a .npz Dorylus archive, an edge list "
    f"({'/'.join(EDGELIST_SUFFIXES)}) with X.features.npy and X.labels.npy beside it, "
    "or an OGB node-property directory (raw/edge.csv.gz, raw/node-feat.csv.gz, "
    "raw/node-label.csv.gz, split/<scheme>/), "
    "or a dataset directory (meta.json with format dorylus-dataset, from `dorylus generate`)"
)
DATASET_FORMAT = "dorylus-dataset"
DATASET_VERSIONS = (1,)
DATASET_META = "meta.json"

# Errors that reading a damaged file can raise; every one becomes a DatasetError naming the file.
_READ_ERRORS = (OSError, EOFError, ValueError, zipfile.BadZipFile, zlib.error)


def _require_file(path: Path, what: str = "file") -> None:
    if not path.is_file():
        reason = "is a directory, not a file" if path.is_dir() else "not found"
        raise DatasetError(f"{path}: {what} {reason}")


def _external_labels(labels: np.ndarray, where: str) -> np.ndarray:
    """Labels from another library: ``[N]`` or ``[N, 1]``; float NaN (unlabeled) -> ``-1``."""
    if labels.ndim == 2 and labels.shape[1] == 1:
        labels = labels[:, 0]
    elif labels.ndim != 1:
        raise DatasetError(
            f"{where}: labels must be [N] or [N, 1], got shape {labels.shape} "
            "(multi-task labels are not supported)"
        )
    if np.issubdtype(labels.dtype, np.floating):
        labels = np.where(np.isnan(labels), -1.0, labels)
    return labels


def _default_num_classes(labels: np.ndarray) -> int:
    return int(labels.max()) + 1 if labels.size else 0


def _np_load(path: Path, what: str, archive: bool) -> Any:
    """``np.load`` without pickles, after checking the file is the kind of NumPy file expected
    (an ``.npz`` archive if ``archive``, else a ``.npy`` array); failures name ``path``."""
    _require_file(path, what)
    try:
        with open(path, "rb") as f:
            magic = f.read(6)
    except OSError as e:
        raise DatasetError(f"{path}: cannot read {what} ({e.strerror or e})") from e
    is_npz, is_npy = magic.startswith(b"PK"), magic.startswith(b"\x93NUMPY")
    if not (is_npz if archive else is_npy):
        if is_npz or is_npy:
            want = "a .npz archive" if archive else "a .npy array"
            got = "a .npz archive" if is_npz else "a single .npy array"
            raise DatasetError(f"{path}: {what} must be {want}, got {got}")
        kind = ".npz" if archive else ".npy"
        raise DatasetError(f"{path}: {what} is not a NumPy {kind} file (corrupt or wrong type)")
    try:
        return np.load(path, allow_pickle=False)
    except _READ_ERRORS as e:
        raise DatasetError(f"{path}: corrupt {what} ({e})") from e


def _read_member(archive: Any, key: str, path: Path) -> np.ndarray:
    try:
        return archive[key]
    except _READ_ERRORS as e:
        raise DatasetError(f"{path}: cannot read key {key!r} ({e})") from e


# --------------------------------------------------------------------------------------------
# .npz archive


def _npy_header(f) -> tuple[tuple[int, ...], bool, np.dtype]:
    """``(shape, fortran_order, dtype)`` of the ``.npy`` at ``f``'s position; ``f`` is left at
    the first data byte."""
    version = np.lib.format.read_magic(f)
    reader = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
    return reader(f)


def _npz_member(path: Path, key: str) -> tuple[int, np.dtype, tuple[int, ...], bool] | None:
    """Where member ``key`` of an *uncompressed* ``.npz`` keeps its array: ``(byte offset of the
    data, dtype, shape, fortran_order)``; ``None`` if the member is compressed or absent.

    A stored zip member is its ``.npy`` bytes verbatim after the local file header (30 bytes,
    then the name and the extra field, whose lengths the header gives)."""
    try:
        with zipfile.ZipFile(path) as archive:
            try:
                info = archive.getinfo(key + ".npy")
            except KeyError:
                return None
            if info.compress_type != zipfile.ZIP_STORED:
                return None
        with open(path, "rb") as f:
            f.seek(info.header_offset)
            local = f.read(30)
            if local[:4] != b"PK\x03\x04":
                return None
            start = info.header_offset + 30 + int.from_bytes(local[26:28], "little") + int.from_bytes(local[28:30], "little")
            f.seek(start)
            shape, fortran, dtype = _npy_header(f)
            if dtype.hasobject:
                return None
            return f.tell(), dtype, shape, fortran
    except _READ_ERRORS as e:
        raise DatasetError(f"{path}: corrupt dataset archive ({e})") from e


def _npz_mapped(path: Path, key: str) -> np.ndarray | None:
    """Member ``key`` memory-mapped read-only, or ``None`` when it is compressed."""
    found = _npz_member(path, key)
    if found is None:
        return None
    offset, dtype, shape, fortran = found
    if int(np.prod(shape)) == 0:
        return np.zeros(shape, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=shape, order="F" if fortran else "C")


def load_npz(path: PathLike, *, mmap: bool = True) -> GraphDataset:
    """Load a Dorylus ``.npz`` archive (format in the module docstring).

    With ``mmap`` (the default) the features of an uncompressed archive are memory-mapped, not
    copied; other members are read one at a time (ids are converted to ``int64`` by validation).
    """
    path = Path(path)
    archive = _np_load(path, "dataset archive", archive=True)
    with archive:
        missing = [key for key in NPZ_REQUIRED if key not in archive.files]
        if missing:
            raise DatasetError(
                f"{path}: missing key {', '.join(repr(k) for k in missing)} "
                f"(an archive needs {', '.join(NPZ_REQUIRED)})"
            )

        def read(key: str) -> np.ndarray:
            return _read_member(archive, key, path)

        def scalar(key: str, convert: Any) -> Any:
            value = read(key)
            if value.size != 1:
                raise DatasetError(f"{path}: key {key!r} must be a scalar, got shape {value.shape}")
            try:
                return convert(value.reshape(()).item())
            except (TypeError, ValueError) as e:
                raise DatasetError(f"{path}: key {key!r} has invalid value {value!r}") from e

        arrays = {}
        for key in NPZ_REQUIRED:
            mapped = _npz_mapped(path, key) if mmap and key == "features" else None
            arrays[key] = mapped if mapped is not None else read(key)
        files = set(archive.files)
        num_classes = (
            scalar("num_classes", int) if "num_classes" in files
            else _default_num_classes(arrays["labels"])
        )
        directed = scalar("directed", bool) if "directed" in files else False
        name = scalar("name", str) if "name" in files else path.stem
    dataset = GraphDataset(name=name, num_classes=num_classes, directed=directed, **arrays)
    return dataset.validate(where=str(path))


def save_npz(dataset: GraphDataset, path: PathLike, *, compress: bool = False) -> None:
    """Write ``dataset`` to ``path`` so that :func:`load_npz` returns it exactly.

    The dataset is validated first; the archive goes to a temporary file in the target's
    directory which then atomically replaces ``path``, so a failure leaves any previous file
    intact and no partial file behind.
    """
    path = Path(path)
    dataset.validate(where=f"{dataset.name} (saving to {path})")
    directory = path.parent
    if not directory.is_dir():
        raise DatasetError(f"{path}: cannot save, directory {directory} does not exist")
    arrays = {key: getattr(dataset, key) for key in NPZ_REQUIRED}
    arrays.update(
        num_classes=np.int64(dataset.num_classes),
        directed=np.bool_(dataset.directed),
        name=np.str_(dataset.name),
    )
    with atomic.writing(path, mode=0o644) as f:  # a dataset is meant to be shared
        (np.savez_compressed if compress else np.savez)(f, **arrays)


# --------------------------------------------------------------------------------------------
# edge list


_INT_TOKEN = re.compile(rb"[+-]?[0-9]+")


def _first_bad_edge_line(raw: bytes) -> tuple[int, str, str] | None:
    """Slow path, only after the fast parser failed: ``(line number, line, reason)``."""
    for number, line in enumerate(io.BytesIO(raw), start=1):
        fields = line.split(b"#", 1)[0].replace(b",", b" ").split()
        if not fields:
            continue
        text = line.decode("utf-8", "replace").rstrip("\r\n")
        if len(fields) != 2:
            return number, text, f"expected 2 vertex ids (src dst), got {len(fields)} fields"
        for field in fields:
            if not _INT_TOKEN.fullmatch(field) or not -(2**63) <= int(field) < 2**63:
                shown = field.decode("utf-8", "replace")
                return number, text, f"{shown!r} is not an integer vertex id"
    return None


def _parse_int_pairs(source: Any) -> np.ndarray | None:
    """numpy's C parser on a path or binary file: ``int64 [rows, columns]``, ``None`` if a
    line does not parse or the column count changes."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "input contained no data"
            return np.loadtxt(source, dtype=np.int64, comments="#", ndmin=2)
    except (ValueError, OverflowError):  # UnicodeDecodeError is a ValueError
        return None


def _read_edge_pairs(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """Parse an edge-list text file into ``src, dst`` (``int64 [E]``).

    Whitespace-separated files stream through numpy's parser; a file with commas is read
    whole and its commas turned into spaces first (about half the speed). Only when that
    fails does a per-line Python pass run, to name the first bad line.
    """
    _require_file(path, "edge list")
    pairs = _parse_int_pairs(path)
    if pairs is None:
        try:
            raw = path.read_bytes()
        except OSError as e:
            raise DatasetError(f"{path}: cannot read edge list ({e.strerror or e})") from e
        if b"," in raw:
            pairs = _parse_int_pairs(io.BytesIO(raw.replace(b",", b" ")))
    if pairs is not None and pairs.size == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    if pairs is None or pairs.shape[1] != 2:
        bad = _first_bad_edge_line(path.read_bytes())
        if bad is None:  # the two parsers disagree on some exotic input
            raise DatasetError(f"{path}: cannot parse as an edge list of 'src dst' lines")
        number, line, reason = bad
        shown = line if len(line) <= 80 else line[:77] + "..."
        raise DatasetError(f"{path}: line {number}: {reason}: {shown!r}")
    return np.ascontiguousarray(pairs[:, 0]), np.ascontiguousarray(pairs[:, 1])


def _load_split(path: Path) -> dict[str, np.ndarray]:
    with _np_load(path, "split file", archive=True) as archive:
        missing = [key for key in MASK_NAMES if key not in archive.files]
        if missing:
            raise DatasetError(f"{path}: split file is missing key {', '.join(missing)}")
        return {key: _read_member(archive, key, path) for key in MASK_NAMES}


def random_split(
    labels: np.ndarray,
    seed: int = 0,
    fractions: tuple[float, float, float] = DEFAULT_SPLIT_FRACTIONS,
) -> dict[str, np.ndarray]:
    """Shuffle the labeled vertices (``labels >= 0``) with ``default_rng(seed)`` and cut them
    into train / val / test masks (``bool [N]``) of ``round(fraction * labeled)`` vertices each
    (test takes the rest; train gets at least one vertex when any is labeled)."""
    labeled = np.flatnonzero(labels >= 0)
    order = np.random.default_rng(seed).permutation(labeled)
    n_train = max(1, round(fractions[0] * len(order))) if len(order) else 0
    n_val = min(round(fractions[1] * len(order)), len(order) - n_train)
    masks = {key: np.zeros(labels.shape[0], dtype=bool) for key in MASK_NAMES}
    masks["train_mask"][order[:n_train]] = True
    masks["val_mask"][order[n_train : n_train + n_val]] = True
    masks["test_mask"][order[n_train + n_val :]] = True
    return masks


def load_edgelist(
    path: PathLike,
    features: PathLike | None = None,
    labels: PathLike | None = None,
    split: PathLike | None = None,
    *,
    num_classes: int | None = None,
    directed: bool = False,
    name: str | None = None,
    seed: int = 0,
) -> GraphDataset:
    """Load an edge-list text file plus its features, labels and optional split.

    ``features``/``labels``/``split`` default to ``X.features.npy``, ``X.labels.npy`` and
    ``X.split.npz`` beside ``X.<ext>``; without a split file a seeded 60/20/20 random split of
    the labeled vertices is made (:func:`random_split` with ``seed``). ``num_classes`` defaults
    to ``max(labels) + 1`` and ``name`` to ``X``.
    """
    path = Path(path)
    base = path.with_suffix("")
    src, dst = _read_edge_pairs(path)
    def side_file(given: PathLike | None, suffix: str) -> Path:
        return Path(given) if given is not None else base.with_name(base.name + suffix)

    feature_path = side_file(features, ".features.npy")
    label_path = side_file(labels, ".labels.npy")
    split_path = side_file(split, ".split.npz")
    for what, given, side in (("features", features, feature_path), ("labels", labels, label_path)):
        if given is None and not side.exists():
            raise DatasetError(
                f"{side}: {what} file not found "
                f"(pass {what}= or put it beside the edge list {path.name})"
            )
    feature_array = _np_load(feature_path, "features file", archive=False)
    label_array = _np_load(label_path, "labels file", archive=False)
    if split is not None or split_path.exists():
        masks = _load_split(split_path)
    elif label_array.ndim == 1 and np.issubdtype(label_array.dtype, np.integer):
        masks = random_split(label_array, seed)
    else:  # let validation report the bad labels
        masks = {key: np.zeros(label_array.shape[:1], dtype=bool) for key in MASK_NAMES}
    dataset = GraphDataset(
        name=name if name is not None else base.name,
        src=src,
        dst=dst,
        features=feature_array,
        labels=label_array,
        num_classes=num_classes if num_classes is not None else _default_num_classes(label_array),
        directed=directed,
        **masks,
    )
    return dataset.validate(where=str(path))


# --------------------------------------------------------------------------------------------
# OGB


def _ogb_root(path: Path) -> Path | None:
    """The OGB dataset directory at ``path`` (it has ``raw/``) or the only one directly inside
    it; ``None`` if there is none. Several candidates is an error."""
    if (path / "raw").is_dir():
        return path
    try:
        candidates = sorted(child for child in path.iterdir() if (child / "raw").is_dir())
    except OSError as e:
        raise DatasetError(f"{path}: cannot list directory ({e.strerror or e})") from e
    if len(candidates) > 1:
        names = ", ".join(child.name for child in candidates)
        raise DatasetError(f"{path}: holds several OGB datasets ({names}); pass one of them")
    return candidates[0] if candidates else None


def _read_gz_csv(path: Path, dtype: type) -> np.ndarray:
    """A headerless gzip CSV as a ``[rows, columns]`` array (``[0, 1]`` when empty)."""
    import gzip

    _require_file(path)
    try:
        with gzip.open(path, "rb") as f, warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "input contained no data"
            return np.loadtxt(f, delimiter=",", dtype=dtype, ndmin=2)
    except _READ_ERRORS as e:
        raise DatasetError(f"{path}: cannot read as gzip CSV ({e})") from e


def load_ogb(
    directory: PathLike,
    *,
    directed: bool = False,
    split: str | None = None,
    name: str | None = None,
) -> GraphDataset:
    """Load an OGB node-property-prediction dataset directory (layout in the module docstring)
    without the ``ogb`` package. ``split`` picks the ``split/<scheme>`` directory when there
    are several; ``name`` defaults to the directory name with ``ogbn_`` written ``ogbn-``."""
    directory = Path(directory)
    if not directory.is_dir():
        reason = "is a file, not a directory" if directory.exists() else "not found"
        raise DatasetError(f"{directory}: OGB dataset directory {reason}")
    root = _ogb_root(directory)
    if root is None:
        raise DatasetError(
            f"{directory}: not an OGB node-property dataset (no raw/ directory in it or in "
            "exactly one subdirectory)"
        )
    raw = root / "raw"

    edge_file, feature_file, label_file = (
        raw / "edge.csv.gz", raw / "node-feat.csv.gz", raw / "node-label.csv.gz"
    )
    edges = _read_gz_csv(edge_file, np.int64)
    if edges.size == 0:
        edges = np.zeros((0, 2), np.int64)
    if edges.shape[1] != 2:
        raise DatasetError(f"{edge_file}: expected 2 columns (src,dst), got {edges.shape[1]}")
    features = _read_gz_csv(feature_file, np.float32)
    labels = _external_labels(_read_gz_csv(label_file, np.float64), str(label_file))
    num_node_file = raw / "num-node-list.csv.gz"
    if num_node_file.exists():
        counts = _read_gz_csv(num_node_file, np.int64)
        if counts.size != 1:
            raise DatasetError(
                f"{num_node_file}: expected one node count (a single graph), got {counts.size}"
            )
        if int(counts.item()) != features.shape[0]:
            raise DatasetError(
                f"{num_node_file}: says {int(counts.item())} nodes but "
                f"{feature_file} has {features.shape[0]} rows"
            )

    split_root = root / "split"
    schemes = []
    if split_root.is_dir():
        schemes = sorted(child.name for child in split_root.iterdir() if child.is_dir())
    if split is None:
        if len(schemes) != 1:
            found = ", ".join(schemes) if schemes else "none"
            raise DatasetError(
                f"{split_root}: expected exactly one split scheme directory, found {found}"
                + ("; choose one with split=" if schemes else "")
            )
        split = schemes[0]
    elif split not in schemes:
        found = ", ".join(schemes) or "none"
        raise DatasetError(f"{split_root}: no split scheme {split!r} (found: {found})")
    n = features.shape[0]
    masks = {}
    for key, file_name in OGB_SPLIT_FILES.items():
        index_file = split_root / split / file_name
        index = _read_gz_csv(index_file, np.int64).ravel()
        if index.size and (index.min() < 0 or index.max() >= n):
            bad = int(index[(index < 0) | (index >= n)][0])
            raise DatasetError(f"{index_file}: vertex id {bad} out of range [0, {n})")
        masks[key] = np.zeros(n, dtype=bool)
        masks[key][index] = True

    if name is None:
        name = "ogbn-" + root.name[5:] if root.name.startswith("ogbn_") else root.name
    dataset = GraphDataset(
        name=name,
        src=np.ascontiguousarray(edges[:, 0]),
        dst=np.ascontiguousarray(edges[:, 1]),
        features=features,
        labels=labels,
        num_classes=_default_num_classes(labels),
        directed=directed,
        **masks,
    )
    return dataset.validate(where=str(root))


# --------------------------------------------------------------------------------------------
# PyG and DGL objects


def _to_numpy(value: Any) -> np.ndarray:
    """A torch tensor (any device, with or without grad) or array-like as a numpy array."""
    if hasattr(value, "detach"):
        value = value.detach().cpu().numpy()
    return np.asarray(value)


def _from_arrays(
    where: str, name: str, src: Any, dst: Any, fields: dict[str, Any],
    num_classes: int | None, directed: bool,
) -> GraphDataset:
    labels = _external_labels(_to_numpy(fields["labels"]), where)
    dataset = GraphDataset(
        name=name,
        src=_to_numpy(src),
        dst=_to_numpy(dst),
        features=_to_numpy(fields["features"]),
        labels=labels,
        train_mask=_to_numpy(fields["train_mask"]),
        val_mask=_to_numpy(fields["val_mask"]),
        test_mask=_to_numpy(fields["test_mask"]),
        num_classes=num_classes if num_classes is not None else _default_num_classes(labels),
        directed=directed,
    )
    return dataset.validate(where=where)


def from_pyg(
    data: Any, name: str = "pyg", *, num_classes: int | None = None, directed: bool = False
) -> GraphDataset:
    """Convert a ``torch_geometric.data.Data`` (``edge_index [2, E]``, ``x``, ``y``,
    ``train_mask``, ``val_mask``, ``test_mask``). ``num_classes`` defaults to ``max(y) + 1``."""
    try:
        from torch_geometric.data import Data
    except ImportError as e:
        raise DatasetError("from_pyg needs torch_geometric: pip install 'dorylus[pyg]'") from e
    where = f"PyG Data {name!r}"
    if not isinstance(data, Data):
        raise DatasetError(
            f"{where}: expected a torch_geometric.data.Data, got {type(data).__name__}"
        )
    attrs = {"edge_index": "edge_index", "features": "x", "labels": "y"}
    attrs.update({mask: mask for mask in MASK_NAMES})
    fields = {key: getattr(data, attr, None) for key, attr in attrs.items()}
    missing = [attrs[key] for key, value in fields.items() if value is None]
    if missing:
        raise DatasetError(f"{where}: missing attribute {', '.join(missing)}")
    edge_index = _to_numpy(fields.pop("edge_index"))
    if edge_index.ndim != 2 or edge_index.shape[0] != 2:
        raise DatasetError(f"{where}: edge_index must have shape [2, E], got {edge_index.shape}")
    return _from_arrays(where, name, edge_index[0], edge_index[1], fields, num_classes, directed)


def from_dgl(
    graph: Any, name: str = "dgl", *, num_classes: int | None = None, directed: bool = False
) -> GraphDataset:
    """Convert a homogeneous DGL graph: edges from ``graph.edges()``, and ``graph.ndata``
    entries ``feat``, ``label``, ``train_mask``, ``val_mask``, ``test_mask``.
    ``num_classes`` defaults to ``max(label) + 1``."""
    try:
        import dgl
    except ImportError as e:
        raise DatasetError("from_dgl needs dgl: pip install 'dorylus[dgl]'") from e
    where = f"DGL graph {name!r}"
    if not isinstance(graph, dgl.DGLGraph):
        raise DatasetError(f"{where}: expected a dgl.DGLGraph, got {type(graph).__name__}")
    if len(graph.ntypes) != 1 or len(graph.etypes) != 1:
        raise DatasetError(
            f"{where}: heterogeneous graphs ({len(graph.ntypes)} node types, "
            f"{len(graph.etypes)} edge types) are not supported"
        )
    keys = {"features": "feat", "labels": "label", **{m: m for m in MASK_NAMES}}
    missing = [ndata_key for ndata_key in keys.values() if ndata_key not in graph.ndata]
    if missing:
        raise DatasetError(f"{where}: missing ndata {', '.join(repr(k) for k in missing)}")
    fields = {key: graph.ndata[ndata_key] for key, ndata_key in keys.items()}
    src, dst = graph.edges()
    return _from_arrays(where, name, src, dst, fields, num_classes, directed)


# --------------------------------------------------------------------------------------------
# CLI entry point


def _synthetic_module() -> Any | None:
    """``dorylus.data.synthetic`` if it exists (imported lazily: presets are optional)."""
    # import_module reads sys.modules first, so tests can substitute a module there.
    try:
        return importlib.import_module("dorylus.data.synthetic")
    except ModuleNotFoundError as e:
        if e.name == "dorylus.data.synthetic":
            return None
        raise  # a real bug inside the module must not pass as "no presets"


def load_dataset(
    spec: str | os.PathLike, *, directed: bool | None = None, seed: int = 0
) -> GraphDataset:
    """Load a dataset from a preset name or a path (``.npz``, edge list, OGB directory).

    ``directed`` overrides the format's default (``None`` keeps it); ``seed`` seeds a preset's
    generator and an edge list's random split.
    """
    spec = os.fspath(spec)
    synthetic = _synthetic_module()
    presets = list(synthetic.preset_names()) if synthetic is not None else []
    streamed = list(getattr(synthetic, "streamed_preset_names", lambda: [])()) if synthetic is not None else []
    if spec in streamed and not Path(spec).exists():
        raise DatasetError(
            f"preset {spec!r} is generated to disk, not in memory: run `dorylus generate {spec} --out DIR`, "
            "then pass DIR as the dataset"
        )
    if spec in presets:
        dataset = synthetic.generate_preset(spec, seed=seed).validate(where=f"preset {spec!r}")
    else:
        path = Path(spec)
        if not path.exists():
            raise DatasetError(
                f"dataset {spec!r} is neither a preset (known: {', '.join(presets) or 'none'}) "
                "nor an existing path"
            )
        root = _ogb_root(path) if path.is_dir() and not (path / DATASET_META).is_file() else None
        if path.is_dir() and (path / DATASET_META).is_file():
            dataset = load_dataset_dir(path)
        elif root is not None:
            dataset = load_ogb(root)
        elif path.is_file() and path.suffix.lower() == ".npz":
            dataset = load_npz(path)
        elif path.is_file() and path.suffix.lower() in EDGELIST_SUFFIXES:
            dataset = load_edgelist(path, seed=seed)
        else:
            suffix = path.suffix or "(no extension)"
            kind = "directory" if path.is_dir() else f"file type {suffix!r}"
            raise DatasetError(f"{path}: unsupported dataset {kind}; supported: {SUPPORTED_TYPES}")
    if directed is not None:
        dataset.directed = directed
    return dataset


# --------------------------------------------------------------------------------------------
# dataset directory (memory-mapped) and edge streams (bounded chunks)


def _dataset_meta(path: Path) -> dict:
    """The checked ``meta.json`` of a dataset directory."""
    meta_path = path / DATASET_META
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError) as e:
        raise DatasetError(f"{meta_path}: cannot read dataset meta ({e})") from e
    if not isinstance(meta, dict) or meta.get("format") != DATASET_FORMAT:
        raise DatasetError(f"{meta_path}: not a Dorylus dataset directory (format must be {DATASET_FORMAT!r})")
    if meta.get("version") not in DATASET_VERSIONS:
        raise DatasetError(f"{meta_path}: dataset version {meta.get('version')!r}; this dorylus reads "
                           f"{', '.join(map(str, DATASET_VERSIONS))}")
    for key, kind in (("num_nodes", int), ("num_edges", int), ("num_features", int), ("num_classes", int),
                      ("directed", bool), ("symmetric", bool), ("name", str)):
        if not isinstance(meta.get(key), kind) or (kind is int and isinstance(meta.get(key), bool)):
            raise DatasetError(f"{meta_path}: {key!r} must be {kind.__name__}, got {meta.get(key)!r}")
    return meta


def _mapped_npy(path: Path, what: str, shape: tuple[int, ...]) -> np.ndarray:
    """A ``.npy`` memory-mapped read-only, its shape checked against ``meta.json``'s."""
    _require_file(path, what)
    try:
        array = np.load(path, mmap_mode="r", allow_pickle=False)
    except _READ_ERRORS as e:
        raise DatasetError(f"{path}: corrupt {what} ({e})") from e
    if array.shape != shape:
        raise DatasetError(f"{path}: {what} has shape {array.shape}, meta.json says {shape}")
    return array


def load_dataset_dir(path: PathLike) -> GraphDataset:
    """Load a dataset directory (format in the module docstring).

    Features stay memory-mapped (pages are read when used); ids, labels and masks are converted
    to the canonical in-memory dtypes by validation (``int64`` ids: 16 bytes per edge)."""
    path = Path(path)
    meta = _dataset_meta(path)
    n, e, f = meta["num_nodes"], meta["num_edges"], meta["num_features"]
    arrays = {"src": _mapped_npy(path / "src.npy", "edge sources", (e,)),
              "dst": _mapped_npy(path / "dst.npy", "edge targets", (e,)),
              "features": _mapped_npy(path / "features.npy", "features", (n, f)),
              "labels": _mapped_npy(path / "labels.npy", "labels", (n,))}
    for key in MASK_NAMES:
        arrays[key] = _mapped_npy(path / f"{key}.npy", key, (n,))
    dataset = GraphDataset(name=meta["name"], num_classes=meta["num_classes"], directed=meta["directed"], **arrays)
    return dataset.validate(where=str(path))


# Edges per chunk of an edge stream when the caller names none: 8M edges, 128 MB as int64 pairs.
DEFAULT_CHUNK_EDGES = 1 << 23


@dataclass
class EdgeStream:
    """A graph opened for one or more passes over its edges in bounded chunks.

    Attributes:
        name, num_nodes, num_edges, num_features, num_classes, directed: as in
            :class:`GraphDataset`.
        symmetric: ``True`` when the edge list is known to hold every pair both ways, once each,
            without self-loops (a generated dataset directory): readers may then skip
            symmetrization and deduplication.
        where: the file or preset, for messages.
    """

    name: str
    num_nodes: int
    num_edges: int
    num_features: int
    num_classes: int
    directed: bool
    symmetric: bool
    where: str
    _chunks: Callable[[int], Iterator[tuple[np.ndarray, np.ndarray]]]
    _vertices: Callable[[], dict]
    in_memory: GraphDataset | None = None  # set when the format had to be loaded whole

    def count_edges(self, chunk_edges: int = DEFAULT_CHUNK_EDGES) -> int:
        """``num_edges``, counted with one pass when the format does not say (edge lists)."""
        if self.num_edges < 0:
            self.num_edges = sum(int(src.shape[0]) for src, _ in self.chunks(chunk_edges))
        return self.num_edges

    def chunks(self, chunk_edges: int = DEFAULT_CHUNK_EDGES) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """``(src, dst)`` pairs of ``int64`` arrays of at most ``chunk_edges`` edges, in file
        order, each checked to lie in ``[0, N)``. Every call is a new pass from the start."""
        if isinstance(chunk_edges, bool) or int(chunk_edges) < 1:
            raise DatasetError(f"chunk_edges must be a positive integer, got {chunk_edges!r}")
        n = self.num_nodes
        for src, dst in self._chunks(int(chunk_edges)):
            src, dst = src.astype(np.int64, copy=False), dst.astype(np.int64, copy=False)
            if src.size and (min(src.min(), dst.min()) < 0 or max(src.max(), dst.max()) >= n):
                bad = np.concatenate((src, dst))
                bad = int(bad[(bad < 0) | (bad >= n)][0])
                raise DatasetError(f"{self.where}: edge list has vertex id {bad} out of range [0, {n})")
            yield src, dst

    def fingerprint(self, chunk_edges: int = DEFAULT_CHUNK_EDGES) -> str:
        """:meth:`GraphDataset.fingerprint` of the dataset this stream reads (the same digest, so a
        run started from a stream resumes against :func:`load_dataset`), computed in bounded
        memory: two passes over the edges (sources, then targets) and one over feature row blocks.
        The passes check what :meth:`GraphDataset.validate` would (ids in range, labels, masks,
        finite features), so a bad dataset fails here, before anything is written."""
        if self.in_memory is not None:
            return self.in_memory.fingerprint()
        vertices = self.vertex_data()  # checked first: no pass over the edges for a bad label file
        digest = hashlib.sha256(f"{self.num_classes}:{self.directed}".encode())
        num_edges = self.count_edges(chunk_edges)
        for side, name in enumerate(("src", "dst")):
            digest.update(f"{name}:{np.dtype(np.int64).str}:{(num_edges,)}".encode())
            for pair in self.chunks(chunk_edges):
                digest.update(memoryview(np.ascontiguousarray(pair[side])).cast("B"))
        features = vertices["features"]
        digest.update(f"features:{np.dtype(np.float32).str}:{features.shape}".encode())
        for lo, block in row_blocks(features):
            block = np.ascontiguousarray(block, dtype=np.float32)
            finite = np.isfinite(block)
            if not finite.all():
                row, col = np.argwhere(~finite)[0]
                raise DatasetError(f"{self.where}: features contain NaN or inf (first at vertex {lo + row}, "
                                   f"column {col})")
            digest.update(memoryview(block).cast("B"))
        for name in ("labels", *MASK_NAMES):
            array = np.ascontiguousarray(vertices[name])
            digest.update(f"{name}:{array.dtype.str}:{array.shape}".encode())
            digest.update(memoryview(array).cast("B"))
        return digest.hexdigest()

    def vertex_data(self) -> dict:
        """``features`` (memory-mapped where the format allows), ``labels``, and the three masks,
        checked like :meth:`GraphDataset.validate` checks them (features' finiteness is left to
        the reader of each row block)."""
        return self._vertices()

    @classmethod
    def from_dataset(cls, dataset: GraphDataset, where: str) -> "EdgeStream":
        """A stream over a dataset already in memory (a preset, an OGB directory)."""

        def chunks(size: int):
            for lo in range(0, dataset.num_edges, size):
                yield dataset.src[lo : lo + size], dataset.dst[lo : lo + size]

        def vertices() -> dict:
            return {"features": dataset.features, "labels": dataset.labels,
                    **{key: getattr(dataset, key) for key in MASK_NAMES}}

        return cls(dataset.name, dataset.num_nodes, dataset.num_edges, dataset.num_features, dataset.num_classes,
                   dataset.directed, False, where, chunks, vertices, in_memory=dataset)


ROW_BLOCK_BYTES = 64 << 20


def file_backed(matrix: np.ndarray) -> bool:
    return isinstance(matrix, np.memmap) and matrix.filename is not None and matrix.flags.c_contiguous


def row_blocks(matrix: np.ndarray, block_bytes: int = ROW_BLOCK_BYTES) -> Iterator[tuple[int, np.ndarray]]:
    """``(first_row, rows)`` blocks of ``matrix`` in order, about ``block_bytes`` each. A
    memory-mapped matrix is read with plain reads: pages faulted in through a map stay resident
    in (and are counted against) this process until the map is closed."""
    n = matrix.shape[0]
    step = max(1, block_bytes // max(1, matrix[:1].nbytes))
    if not file_backed(matrix):
        for lo in range(0, n, step):
            yield lo, matrix[lo : lo + step]
        return
    width = int(np.prod(matrix.shape[1:], dtype=np.int64))
    blocks = _read_slices(Path(matrix.filename), matrix.offset, matrix.dtype, n * width, step * width)
    for lo, block in zip(range(0, n, step), blocks):
        yield lo, block.reshape(-1, *matrix.shape[1:])


def read_row_range(matrix: np.ndarray, start: int, stop: int) -> np.ndarray:
    """``matrix[start:stop]`` as a new array; from a memory-mapped matrix by one plain read (see
    :func:`row_blocks`), so the rows are resident only while the caller holds them."""
    if not file_backed(matrix):
        return np.array(matrix[start:stop])
    start, stop, _ = slice(start, stop).indices(matrix.shape[0])
    stop = max(start, stop)
    width = int(np.prod(matrix.shape[1:], dtype=np.int64))
    count = (stop - start) * width
    if count == 0:
        return np.empty((0, *matrix.shape[1:]), matrix.dtype)
    offset = matrix.offset + start * width * matrix.itemsize
    block = next(_read_slices(Path(matrix.filename), offset, matrix.dtype, count, count))
    return block.reshape(-1, *matrix.shape[1:])


def take_rows(matrix: np.ndarray, rows: np.ndarray, block_bytes: int = ROW_BLOCK_BYTES) -> np.ndarray:
    """``matrix[rows]`` for ascending ``rows``; from a memory-mapped matrix by plain reads of row
    blocks (see :func:`row_blocks`), each block spanning only its first to last wanted row."""
    rows = np.asarray(rows, dtype=np.int64)
    if not file_backed(matrix):
        return np.asarray(matrix[rows])
    out = np.empty((rows.size, *matrix.shape[1:]), dtype=matrix.dtype)
    width = int(np.prod(matrix.shape[1:], dtype=np.int64))
    step = max(1, block_bytes // max(1, width * matrix.itemsize))
    with open(matrix.filename, "rb") as f:
        a = 0
        while a < rows.size:
            # The wanted rows among the next ``step`` rows of the file: one read of at most a block.
            b = int(np.searchsorted(rows, rows[a] + step))
            first, last = int(rows[a]), int(rows[b - 1])
            f.seek(matrix.offset + first * width * matrix.itemsize)
            block = np.fromfile(f, dtype=matrix.dtype, count=(last - first + 1) * width)
            if block.size != (last - first + 1) * width:
                raise DatasetError(f"{matrix.filename}: truncated (rows {first}..{last} of {matrix.shape[0]})")
            out[a:b] = block.reshape(-1, *matrix.shape[1:])[rows[a:b] - first]
            a = b
    return out


def _read_slices(path: Path, offset: int, dtype: np.dtype, count: int, size: int) -> Iterator[np.ndarray]:
    """``count`` items of ``dtype`` from byte ``offset`` of ``path``, ``size`` at a time, by plain
    reads (a memory map would leave every page read resident in this process)."""
    with open(path, "rb") as f:
        f.seek(offset)
        for lo in range(0, count, size):
            chunk = np.fromfile(f, dtype=dtype, count=min(size, count - lo))
            if chunk.size != min(size, count - lo):
                raise DatasetError(f"{path}: truncated ({lo + chunk.size} of {count} values)")
            yield chunk


def _npy_slices(path: Path, what: str, count: int, size: int) -> Iterator[np.ndarray]:
    _require_file(path, what)
    with open(path, "rb") as f:
        try:
            shape, fortran, dtype = _npy_header(f)
        except _READ_ERRORS as e:
            raise DatasetError(f"{path}: corrupt {what} ({e})") from e
        offset = f.tell()
    if shape != (count,) or not np.issubdtype(dtype, np.integer):
        raise DatasetError(f"{path}: {what} must be integer [{count}], got {dtype} {shape}")
    return _read_slices(path, offset, dtype, count, size)


def _npz_edge_slices(path: Path, key: str, size: int) -> Iterator[np.ndarray]:
    """Member ``key`` of an ``.npz`` in slices: plain reads at its offset when stored,
    sequential decompression when deflated (no random access, so one full pass per call)."""
    found = _npz_member(path, key)
    if found is not None:
        offset, dtype, shape, _ = found
        if len(shape) != 1 or not np.issubdtype(dtype, np.integer):
            raise DatasetError(f"{path}: key {key!r} must be a 1-D integer array, got {dtype} {shape}")
        yield from _read_slices(path, offset, dtype, shape[0], size)
        return
    try:
        with zipfile.ZipFile(path) as archive, archive.open(key + ".npy") as f:
            shape, _, dtype = _npy_header(f)
            if len(shape) != 1 or not np.issubdtype(dtype, np.integer):
                raise DatasetError(f"{path}: key {key!r} must be a 1-D integer array, got {dtype} {shape}")
            for lo in range(0, shape[0], size):
                want = min(size, shape[0] - lo) * dtype.itemsize
                raw = f.read(want)
                if len(raw) != want:
                    raise DatasetError(f"{path}: key {key!r} truncated")
                yield np.frombuffer(raw, dtype=dtype)
    except _READ_ERRORS as e:
        raise DatasetError(f"{path}: cannot read key {key!r} ({e})") from e


def _edgelist_chunks(path: Path, size: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """An edge-list text file parsed about ``size`` lines at a time (blocks of whole lines)."""
    _require_file(path, "edge list")
    line_bytes = 16  # a guess at a line's length; only the read size depends on it
    with open(path, "rb") as f:
        number = 0
        while True:
            lines = f.readlines(size * line_bytes)
            if not lines:
                return
            raw = b"".join(lines)
            pairs = _parse_int_pairs(io.BytesIO(raw.replace(b",", b" ")))
            if pairs is None or (pairs.size and pairs.shape[1] != 2):
                bad = _first_bad_edge_line(raw)
                if bad is None:
                    raise DatasetError(f"{path}: cannot parse lines {number + 1}..{number + len(lines)} as 'src dst'")
                line_no, line, reason = bad
                raise DatasetError(f"{path}: line {number + line_no}: {reason}: {line[:80]!r}")
            number += len(lines)
            for lo in range(0, pairs.shape[0] if pairs.size else 0, size):  # never more than size edges
                yield pairs[lo : lo + size, 0], pairs[lo : lo + size, 1]


def _checked_vertices(where: str, n: int, num_classes: int, features: np.ndarray, labels: np.ndarray,
                      masks: dict) -> dict:
    """The per-vertex arrays of a stream, checked as :meth:`GraphDataset.validate` would (but
    without reading every feature: shapes and dtype only)."""
    check_features_form(features, where)
    if features.shape[0] != n:
        raise DatasetError(f"{where}: features must have shape ({n}, F), got {features.shape}")
    probe = GraphDataset(name="probe", src=np.zeros(0, np.int64), dst=np.zeros(0, np.int64),
                         features=np.zeros((n, 1), np.float32), labels=np.asarray(labels),
                         num_classes=num_classes, **{k: np.asarray(v) for k, v in masks.items()})
    probe.validate(where)
    return {"features": features, "labels": probe.labels, **{k: getattr(probe, k) for k in MASK_NAMES}}


def open_edge_stream(spec: str | os.PathLike, *, directed: bool | None = None, seed: int = 0) -> EdgeStream:
    """Open a dataset for streaming: edges in chunks, vertex arrays mapped where possible.

    * Dataset directory: edges read a slice at a time from ``src.npy``/``dst.npy``; vertex
      arrays memory-mapped.
    * ``.npz``: edges read a slice at a time (stored) or decompressed sequentially
      (compressed); features memory-mapped when stored, else read into memory.
    * Edge list: parsed a block of lines at a time; ``N`` is the row count of
      ``X.features.npy`` (memory-mapped), the split as :func:`load_edgelist` makes it.
    * Anything else (presets, OGB directories) is loaded whole by :func:`load_dataset` and
      streamed from memory.
    """
    spec = os.fspath(spec)
    path = Path(spec)
    if path.is_dir() and (path / DATASET_META).is_file():
        meta = _dataset_meta(path)
        n, e, f = meta["num_nodes"], meta["num_edges"], meta["num_features"]

        def dir_chunks(size: int):
            yield from zip(_npy_slices(path / "src.npy", "edge sources", e, size),
                           _npy_slices(path / "dst.npy", "edge targets", e, size))

        def dir_vertices() -> dict:
            return _checked_vertices(str(path), n, meta["num_classes"],
                                     _mapped_npy(path / "features.npy", "features", (n, f)),
                                     _mapped_npy(path / "labels.npy", "labels", (n,)),
                                     {k: _mapped_npy(path / f"{k}.npy", k, (n,)) for k in MASK_NAMES})

        stream = EdgeStream(meta["name"], n, e, f, meta["num_classes"], meta["directed"], meta["symmetric"],
                            str(path), dir_chunks, dir_vertices)
    elif path.is_file() and path.suffix.lower() == ".npz":
        archive = _np_load(path, "dataset archive", archive=True)
        with archive:
            missing = [key for key in NPZ_REQUIRED if key not in archive.files]
            if missing:
                raise DatasetError(f"{path}: missing key {', '.join(repr(k) for k in missing)} "
                                   f"(an archive needs {', '.join(NPZ_REQUIRED)})")
            small = {key: _read_member(archive, key, path) for key in ("labels", *MASK_NAMES)}
            extras = {key: _read_member(archive, key, path).reshape(()).item()
                      for key in ("num_classes", "directed", "name") if key in archive.files}
        features = _npz_mapped(path, "features")
        if features is None:  # compressed: no way to map it
            with np.load(path, allow_pickle=False) as archive:
                features = _read_member(archive, "features", path)
        n = features.shape[0] if features.ndim == 2 else -1
        num_classes = int(extras.get("num_classes", _default_num_classes(small["labels"])))
        with zipfile.ZipFile(path) as z, z.open("src.npy") as f:
            e = _npy_header(f)[0]
        e = e[0] if len(e) == 1 else -1

        def npz_chunks(size: int):
            yield from zip(_npz_edge_slices(path, "src", size), _npz_edge_slices(path, "dst", size))

        def npz_vertices() -> dict:
            masks = {k: small[k] for k in MASK_NAMES}
            return _checked_vertices(str(path), n, num_classes, features, small["labels"], masks)

        stream = EdgeStream(str(extras.get("name", path.stem)), n, e,
                            features.shape[1] if features.ndim == 2 else 0, num_classes,
                            bool(extras.get("directed", False)), False, str(path), npz_chunks, npz_vertices)
    elif path.is_file() and path.suffix.lower() in EDGELIST_SUFFIXES:
        base = path.with_suffix("")
        feature_path = base.with_name(base.name + ".features.npy")
        label_path = base.with_name(base.name + ".labels.npy")
        split_path = base.with_name(base.name + ".split.npz")
        for what, side in (("features", feature_path), ("labels", label_path)):
            if not side.exists():
                raise DatasetError(f"{side}: {what} file not found (put it beside the edge list {path.name})")
        _np_load(feature_path, "features file", archive=False)  # checks the magic, names the file
        try:
            features = np.load(feature_path, mmap_mode="r", allow_pickle=False)
        except _READ_ERRORS as e:
            raise DatasetError(f"{feature_path}: corrupt features file ({e})") from e
        labels = _np_load(label_path, "labels file", archive=False)
        masks = _load_split(split_path) if split_path.exists() else random_split(labels, seed)
        n = features.shape[0]
        num_classes = _default_num_classes(labels)
        num_edges = -1  # unknown until a pass has counted them

        def text_chunks(size: int):
            yield from _edgelist_chunks(path, size)

        def text_vertices() -> dict:
            return _checked_vertices(str(path), n, num_classes, features, labels, masks)

        stream = EdgeStream(base.name, n, num_edges, features.shape[1] if features.ndim == 2 else 0, num_classes,
                            False, False, str(path), text_chunks, text_vertices)
    else:
        dataset = load_dataset(spec, seed=seed)
        stream = EdgeStream.from_dataset(dataset, spec)
    if directed is not None:
        stream.directed = directed
        stream.symmetric = stream.symmetric and not directed
    return stream
