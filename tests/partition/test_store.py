from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from dorylus.data.graph import MASK_NAMES, GraphDataset
from dorylus.errors import ConfigError, StoreError
from dorylus.normalize import gcn_normalize
from dorylus.partition import METHODS, assign_parts, format_stats, open_store, partition_stats, write_store
from dorylus.partition.store import _sha256_file, reassemble
from tests.graphs import shared_data


def make_dataset(n, src, dst, directed=False, name="toy", seed=0) -> GraphDataset:
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 3, n)
    labels[n - 1] = -1  # one unlabeled vertex, in no mask
    split = np.arange(n) % 3
    labelled = labels >= 0
    return GraphDataset(
        name=name, src=np.asarray(src), dst=np.asarray(dst), features=rng.random((n, 4), dtype=np.float32),
        labels=labels, train_mask=(split == 0) & labelled, val_mask=(split == 1) & labelled,
        test_mask=(split == 2) & labelled, num_classes=3, directed=directed,
    )


def undirected_toy() -> GraphDataset:
    # Two triangles joined by an edge, a separate edge with a self-loop, an isolated vertex 8,
    # and a duplicate edge (3, 4).
    return make_dataset(9, [0, 1, 2, 2, 3, 4, 5, 1, 6, 7, 3], [1, 2, 0, 3, 4, 5, 3, 0, 7, 7, 4])


def directed_toy() -> GraphDataset:
    return make_dataset(8, [0, 0, 1, 2, 3, 4, 5, 6, 7, 2, 2], [1, 2, 2, 3, 0, 5, 6, 4, 4, 5, 2], directed=True, name="dtoy")


def load_cora() -> GraphDataset:
    data = np.load(shared_data("cora.npz"))
    return GraphDataset(name="cora", **{k: data[k] for k in data.files}, num_classes=int(data["labels"].max()) + 1)


def dense_a_hat(ds: GraphDataset) -> np.ndarray:
    """Independent oracle: D^-1/2 (A + I) D^-1/2 with A[v, u] = 1 for an edge u -> v."""
    a = np.zeros((ds.num_nodes, ds.num_nodes))
    a[ds.dst, ds.src] = 1.0
    if not ds.directed:
        a[ds.src, ds.dst] = 1.0
    np.fill_diagonal(a, 1.0)
    inv_sqrt = 1.0 / np.sqrt(a.sum(axis=1))
    return inv_sqrt[:, None] * a * inv_sqrt[None, :]


def check_store(ds: GraphDataset, parts: np.ndarray, root: Path, a_hat: np.ndarray) -> None:
    """Every invariant of the store layout, each against a computation independent of the writer."""
    store = open_store(root)
    n, num_parts = ds.num_nodes, int(parts.max()) + 1
    meta = store.meta
    assert (meta.num_nodes, meta.num_edges, meta.num_parts, meta.num_features) == (n, ds.num_edges, num_parts, ds.num_features)
    assert (meta.train_count, meta.val_count, meta.test_count) == tuple(int(getattr(ds, m).sum()) for m in MASK_NAMES)
    assert meta.nnz == np.count_nonzero(a_hat) and meta.symmetrized == (not ds.directed)
    loaded = [store.load_part(i) for i in range(num_parts)]

    # Every vertex owned exactly once, by the part it was assigned to (in the store's order).
    for i, p in enumerate(loaded):
        assert sorted(p.owned.tolist()) == np.flatnonzero(parts == i).tolist()
        assert p.indices.dtype == np.int32 and p.norm.shape == (p.n_local,)

    edge_exists = a_hat != 0
    np.fill_diagonal(edge_exists, False)  # edge_exists[v, u]: u is an in-neighbour of v
    h = np.random.default_rng(1).standard_normal((n, 5))
    for i, p in enumerate(loaded):
        # Ghosts are exactly the remote in-neighbours of owned vertices, ordered by (owner,
        # first owned row that reads them, id).
        in_neighbours = np.flatnonzero(edge_exists[p.owned].any(axis=0))
        expected = in_neighbours[parts[in_neighbours] != i]
        assert sorted(p.ghosts.tolist()) == expected.tolist()
        first_reader = {g: int(np.flatnonzero(edge_exists[p.owned, g])[0]) for g in expected.tolist()}
        assert p.ghosts.tolist() == sorted(expected.tolist(), key=lambda g: (parts[g], first_reader[g], g))
        for j in range(num_parts):
            block = p.ghosts[p.ghost_offsets[j]:p.ghost_offsets[j + 1]]
            assert np.all(parts[block] == j)
            # What j sends to i is i's ghost block from j, in the same order.
            q = loaded[j]
            assert q.owned[q.send_rows(i)].tolist() == block.tolist()
            assert p.global_ids()[p.ghost_rows(j)].tolist() == block.tolist()
        # Rows list local ids ascending, self loop included; A_hat[v, u] = norm[v] norm[u] over
        # local ids equals the dense oracle's rows for owned vertices.
        rows = np.repeat(np.arange(p.n_owned), np.diff(p.indptr))
        keys = rows * p.n_local + p.indices
        assert np.all(np.diff(keys) > 0) and np.all(np.isin(np.arange(p.n_owned) * (p.n_local + 1), keys))
        weights = p.norm[rows].astype(np.float64) * p.norm[p.indices]
        z = np.zeros((p.n_owned, h.shape[1]))
        np.add.at(z, rows, weights[:, None] * h[p.global_ids()][p.indices])
        np.testing.assert_allclose(z, a_hat[p.owned] @ h, rtol=1e-6, atol=1e-7)

    # Reassembled parts are exactly (bitwise) the global normalization and the original arrays.
    back, adj = reassemble(store)
    ref = gcn_normalize(ds.src, ds.dst, n, symmetrize=not ds.directed)
    assert np.array_equal(adj.indptr, ref.indptr) and np.array_equal(adj.indices, ref.indices)
    assert np.array_equal(adj.norm.view(np.uint32), ref.norm.view(np.uint32))
    assert np.array_equal(adj.in_degree, ref.in_degree)
    for field in ("features", "labels", *MASK_NAMES):
        assert np.array_equal(getattr(back, field), getattr(ds, field)), field
    again = gcn_normalize(back.src, back.dst, n, symmetrize=not back.directed)
    assert np.array_equal(again.indices, ref.indices) and np.array_equal(again.weights, ref.weights)


@pytest.mark.parametrize("graph", [undirected_toy, directed_toy, load_cora], ids=["undirected", "directed", "cora"])
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("num_parts", [1, 2, 3, 4])
def test_store_invariants(graph, method, num_parts, tmp_path):
    ds = graph()
    parts = assign_parts(ds.num_nodes, ds.src, ds.dst, num_parts, method, seed=0)
    meta = write_store(ds, parts, tmp_path / "store", method=method, seed=0)
    assert meta.partitioner == method and meta.num_parts == num_parts
    check_store(ds, parts, tmp_path / "store", dense_a_hat(ds))
    assert os.listdir(tmp_path) == ["store"]


def test_cora_four_metis_parts_load_back_to_the_original_graph(tmp_path):
    ds = load_cora()
    parts = assign_parts(ds.num_nodes, ds.src, ds.dst, 4, "metis")
    write_store(ds, parts, tmp_path / "s", method="metis", seed=0)
    back, _ = reassemble(open_store(tmp_path / "s"))
    n = ds.num_nodes
    as_set = lambda s, d: set(np.unique(np.concatenate([d * n + s, s * n + d])).tolist()) - {v * n + v for v in range(n)}
    assert as_set(back.src, back.dst) == as_set(ds.src, ds.dst)
    assert back.num_classes == ds.num_classes and back.name == "cora"


def test_mmap_loading_is_read_only(tmp_path):
    ds = undirected_toy()
    write_store(ds, assign_parts(9, ds.src, ds.dst, 2, "contiguous"), tmp_path / "s", method="contiguous", seed=0)
    p = open_store(tmp_path / "s").load_part(1)
    for array in (p.indices, p.norm, p.indptr):
        assert isinstance(array, np.memmap) and not array.flags.writeable
    assert p.indices.dtype == np.int32
    assert not isinstance(open_store(tmp_path / "s").load_part(1, mmap=False).indices, np.memmap)


@pytest.mark.parametrize("order", ["community", "rcm", "bfs", "none"])
def test_vertex_order_is_recorded_and_a_permutation(tmp_path, order):
    ds = load_cora()
    parts = assign_parts(ds.num_nodes, ds.src, ds.dst, 2, "metis")
    write_store(ds, parts, tmp_path / "s", method="metis", seed=0, vertex_order=order)
    store = open_store(tmp_path / "s")
    assert store.meta.vertex_order == order
    spans = []
    for i in range(2):
        p = store.load_part(i)
        assert sorted(p.owned.tolist()) == np.flatnonzero(parts == i).tolist()
        if order == "none":
            assert np.all(np.diff(p.owned) > 0)
        rows = np.repeat(np.arange(p.n_owned), np.diff(p.indptr))
        inner = p.indices < p.n_owned
        spans.append(np.abs(rows[inner] - p.indices[inner]).mean())
    check_store(ds, parts, tmp_path / "s", dense_a_hat(ds))
    if order != "none":  # neighbours numbered near each other: a random order's mean is n_part / 3
        assert max(spans) < ds.num_nodes / 2 / 5


def test_unknown_vertex_order_is_a_config_error(tmp_path):
    ds = undirected_toy()
    with pytest.raises(ConfigError, match="vertex_order must be one of community, rcm, bfs, none, got 'dfs'"):
        write_store(ds, np.zeros(9, dtype=np.int64), tmp_path / "s", method="contiguous", seed=0, vertex_order="dfs")
    assert not (tmp_path / "s").exists()


def test_store_writer_part_by_part_equals_write_store(tmp_path):
    """The streaming partitioners' API: parts given in any order of their vertices, edges as
    int32 global ids, give the same store as write_store (the writer numbers the vertices)."""
    from dorylus.normalize import edge_keys
    from dorylus.partition import StoreWriter

    ds = load_cora()
    n = ds.num_nodes
    parts = assign_parts(n, ds.src, ds.dst, 3, "metis")
    write_store(ds, parts, tmp_path / "a", method="metis", seed=0)
    keys = edge_keys(ds.src, ds.dst, n, symmetrize=True)
    src, dst = (keys % n).astype(np.int32), (keys // n).astype(np.int32)
    degree = np.bincount(dst, minlength=n).astype(np.int32)
    rng = np.random.default_rng(0)
    with StoreWriter(tmp_path / "b", num_parts=3, num_nodes=n, num_features=ds.num_features,
                     num_classes=ds.num_classes, dataset_name="cora", directed=False, method="metis", seed=0,
                     num_edges=ds.num_edges) as writer:
        for i in (2, 0, 1):
            owned = rng.permutation(np.flatnonzero(parts == i))
            mine = parts[dst] == i
            shuffle = rng.permutation(int(mine.sum()))
            writer.write_part(i, owned, src[mine][shuffle], dst[mine][shuffle], degree, parts.astype(np.int8),
                              ds.features[owned], ds.labels[owned], *(getattr(ds, m)[owned] for m in MASK_NAMES))
        with pytest.raises(ConfigError, match="part 1 is not a part still to write"):
            writer.write_part(1, owned, src[:0], dst[:0], degree, parts, ds.features[owned], ds.labels[owned],
                              *(getattr(ds, m)[owned] for m in MASK_NAMES))
    a, b = open_store(tmp_path / "a"), open_store(tmp_path / "b")
    assert {k: v for k, v in a.meta.to_dict().items() if k not in ("files", "created_by")} == \
        {k: v for k, v in b.meta.to_dict().items() if k not in ("files", "created_by")}
    for i in range(3):
        pa, pb = a.load_part(i), b.load_part(i)
        assert sorted(pa.owned.tolist()) == sorted(pb.owned.tolist()) and pa.nnz == pb.nnz
    check_store(ds, parts, tmp_path / "b", dense_a_hat(ds))


def test_store_writer_checks_its_input(tmp_path):
    from dorylus.partition import StoreWriter

    ds = undirected_toy()
    parts = np.array([0, 0, 0, 0, 1, 1, 1, 1, 1])
    args = dict(num_parts=2, num_nodes=9, num_features=4, num_classes=3, dataset_name="toy", directed=False,
                method="contiguous", seed=0)
    rows = lambda owned: (ds.features[owned], ds.labels[owned], *(getattr(ds, m)[owned] for m in MASK_NAMES))
    owned = np.array([0, 1, 2, 3])
    degree = np.array([2, 2, 3, 3, 2, 2, 1, 1, 0])
    src, dst = np.array([1, 2, 0, 2, 0, 1, 3, 2, 4, 5]), np.array([0, 0, 1, 1, 2, 2, 2, 3, 3, 3])
    with pytest.raises(ConfigError, match="every in-edge needs an owned dst and no self loop"):
        with StoreWriter(tmp_path / "s", **args) as writer:
            writer.write_part(0, owned, np.array([1, 0]), np.array([0, 4]), degree, parts, *rows(owned))
    with pytest.raises(ConfigError, match=r"part 0: degree\[3\] is 5 but the part has 3 distinct in-edges"):
        with StoreWriter(tmp_path / "s", **args) as writer:
            writer.write_part(0, owned, src, dst, np.where(np.arange(9) == 3, 5, degree), parts, *rows(owned))
    with pytest.raises(ConfigError, match="part 1 of 2 was never written"):
        with StoreWriter(tmp_path / "s", **args) as writer:
            writer.write_part(0, owned, src, dst, degree, parts, *rows(owned))
    assert os.listdir(tmp_path) == []  # nothing half-written is left


def test_meta_json_contents(tmp_path):
    ds = undirected_toy()
    parts = assign_parts(9, ds.src, ds.dst, 3, "random", seed=4)
    write_store(ds, parts, tmp_path / "s", method="random", seed=4)
    meta = json.loads((tmp_path / "s" / "meta.json").read_text())
    assert meta == open_store(tmp_path / "s").meta.to_dict()
    assert meta["format_version"] == 3 and meta["normalization"] == "gcn-sym-selfloop"
    assert meta["vertex_order"] == "community"
    assert meta["dataset"] == "toy" and meta["num_edges"] == 11 and meta["seed"] == 4 and not meta["directed"]
    assert meta["created_by"].startswith("dorylus ")
    assert len(meta["files"]) == 3 * 13
    for rel, digest in meta["files"].items():
        assert _sha256_file(tmp_path / "s" / rel) == digest
    assert [p["num_owned"] for p in meta["parts"]] == np.bincount(parts).tolist()


@pytest.fixture
def cora_store(tmp_path):
    """Cora in 4 parts with dense features."""
    ds = load_cora()
    write_store(ds, assign_parts(ds.num_nodes, ds.src, ds.dst, 4, "metis"), tmp_path / "s", method="metis", seed=0,
                sparse_features="off")
    return tmp_path / "s"


def test_corrupt_file_is_named(cora_store):
    path = cora_store / "part-2" / "norm.npy"
    data = bytearray(path.read_bytes())
    data[-7] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(StoreError, match="part-2/norm.npy is corrupt"):
        open_store(cora_store)
    store = open_store(cora_store, verify=False)
    store.verify([0, 1, 3])  # the other parts are fine
    with pytest.raises(StoreError, match="part-2/norm.npy is corrupt"):
        store.verify([2])


def test_missing_part_file_is_named(cora_store):
    (cora_store / "part-1" / "labels.npy").unlink()
    with pytest.raises(StoreError, match="missing file part-1/labels.npy"):
        open_store(cora_store)
    with pytest.raises(StoreError, match="missing file part-1/labels.npy"):
        open_store(cora_store, verify=False).load_part(1)


def rewrite_meta(root: Path, **changes) -> None:
    meta = json.loads((root / "meta.json").read_text())
    meta.update(changes)
    (root / "meta.json").write_text(json.dumps(meta))


def test_wrong_format_version(cora_store):
    rewrite_meta(cora_store, format_version=4)
    with pytest.raises(StoreError, match=f"partition store {cora_store} has format version 4; this dorylus reads 3"):
        open_store(cora_store)


@pytest.mark.parametrize("version", [1, 2])
def test_older_store_is_refused_with_how_to_rebuild(tmp_path, version):
    """A store written before format 3 (weights.npy, int64 indices) is refused, never misread."""
    root = tmp_path / "old"
    (root / "part-0").mkdir(parents=True)
    np.save(root / "part-0" / "weights.npy", np.ones(3, np.float32))
    (root / "meta.json").write_text(json.dumps({"format_version": version, "num_parts": 1}))
    with pytest.raises(StoreError, match=rf"partition store {root} has format version {version} \(int64 indices "
                                         rf"and per-entry weights, from an older dorylus\); this dorylus reads 3: "
                                         rf"rebuild it with `dorylus partition --dataset DATASET --out {root} "
                                         rf"--overwrite`"):
        open_store(root)


def test_missing_and_malformed_meta(tmp_path, cora_store):
    with pytest.raises(StoreError, match="does not exist"):
        open_store(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(StoreError, match="has no meta.json"):
        open_store(tmp_path / "empty")
    (cora_store / "meta.json").write_text('{"format_version": 1, ')
    with pytest.raises(StoreError, match="meta.json: not valid JSON"):
        open_store(cora_store)
    (cora_store / "meta.json").write_text('{"format_version": 3}')
    with pytest.raises(StoreError, match="meta.json: missing key 'dataset'"):
        open_store(cora_store)


def test_meta_must_list_every_file(cora_store):
    meta = json.loads((cora_store / "meta.json").read_text())
    del meta["files"]["part-3/send_offsets.npy"]
    (cora_store / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(StoreError, match="does not list part-3/send_offsets.npy"):
        open_store(cora_store)


def replace_array(root: Path, rel: str, array: np.ndarray) -> None:
    """Swap in a different array and record its checksum, so only the shape checks can catch it."""
    np.save(root / rel, array)
    meta = json.loads((root / "meta.json").read_text())
    meta["files"][rel] = _sha256_file(root / rel)
    (root / "meta.json").write_text(json.dumps(meta))


@pytest.mark.parametrize(
    "rel, make_bad, message",
    [
        ("part-1/indices.npy", lambda a: a + 10**6, r"part-1/indices.npy: local ids must be in \[0, "),
        ("part-0/features.npy", lambda a: a.astype(np.float64), r"part-0/features.npy has dtype float64"),
        ("part-3/indptr.npy", lambda a: a[:-1], r"part-3/indptr.npy has dtype int64 shape"),
        ("part-2/owned.npy", lambda a: np.concatenate([a[1:], a[:1]]) * 0, r"part-2/owned.npy: global ids must be distinct"),
        ("part-1/indices.npy", lambda a: a.astype(np.int64), r"part-1/indices.npy has dtype int64 shape .* expected int32"),
        ("part-1/norm.npy", lambda a: a * 0, r"part-1/norm.npy: entries must be \(1 \+ degree\)\^-1/2"),
        ("part-2/send_indices.npy", lambda a: a + 10**6, r"part-2/send_indices.npy: local ids must be owned"),
        ("part-1/ghost_offsets.npy", lambda a: a[::-1].copy(), r"part-1/ghost_offsets.npy: offsets must rise"),
    ],
)
def test_inconsistent_arrays_are_named(cora_store, rel, make_bad, message):
    replace_array(cora_store, rel, make_bad(np.load(cora_store / rel)))
    store = open_store(cora_store)  # checksums match the swapped files
    part = int(rel.split("/")[0].split("-")[1])
    with pytest.raises(StoreError, match=message):
        store.load_part(part)


def test_existing_non_empty_dir_is_refused_and_left_intact(tmp_path):
    ds = undirected_toy()
    target = tmp_path / "out"
    target.mkdir()
    (target / "keep.txt").write_text("precious")
    with pytest.raises(StoreError, match="refusing to overwrite non-empty directory"):
        write_store(ds, np.zeros(9, dtype=np.int64), target, method="contiguous", seed=0)
    assert os.listdir(target) == ["keep.txt"] and (target / "keep.txt").read_text() == "precious"
    assert sorted(os.listdir(tmp_path)) == ["out"]
    # overwrite replaces only a partition store, never an arbitrary directory.
    with pytest.raises(StoreError, match="not a partition store"):
        write_store(ds, np.zeros(9, dtype=np.int64), target, method="contiguous", seed=0, overwrite=True)
    assert os.listdir(target) == ["keep.txt"]


def test_empty_existing_dir_is_used(tmp_path):
    ds = undirected_toy()
    (tmp_path / "out").mkdir()
    write_store(ds, np.zeros(9, dtype=np.int64), tmp_path / "out", method="contiguous", seed=0)
    assert open_store(tmp_path / "out").num_parts == 1


def test_overwrite_replaces_a_store(tmp_path):
    ds = undirected_toy()
    write_store(ds, np.zeros(9, dtype=np.int64), tmp_path / "s", method="contiguous", seed=0)
    parts = assign_parts(9, ds.src, ds.dst, 3, "random")
    write_store(ds, parts, tmp_path / "s", method="random", seed=0, overwrite=True)
    assert open_store(tmp_path / "s").num_parts == 3 and not (tmp_path / "s" / "part-0" / "extra").exists()
    assert sorted(os.listdir(tmp_path / "s")) == ["meta.json", "part-0", "part-1", "part-2"]
    assert os.listdir(tmp_path) == ["s"]


def failing_third_save(monkeypatch):
    real_save, calls = np.save, []

    def save(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise OSError("disk full (simulated)")
        return real_save(*args, **kwargs)

    monkeypatch.setattr(np, "save", save)


def test_failure_mid_write_leaves_nothing(tmp_path, monkeypatch):
    ds = undirected_toy()
    failing_third_save(monkeypatch)
    with pytest.raises(OSError, match="disk full"):
        write_store(ds, assign_parts(9, ds.src, ds.dst, 2, "random"), tmp_path / "s", method="random", seed=0)
    assert os.listdir(tmp_path) == []


def test_failed_overwrite_keeps_the_old_store(tmp_path, monkeypatch):
    ds = undirected_toy()
    write_store(ds, np.zeros(9, dtype=np.int64), tmp_path / "s", method="contiguous", seed=0)
    before = (tmp_path / "s" / "meta.json").read_text()
    failing_third_save(monkeypatch)
    with pytest.raises(OSError, match="disk full"):
        write_store(ds, assign_parts(9, ds.src, ds.dst, 2, "random"), tmp_path / "s", method="random", seed=0, overwrite=True)
    assert os.listdir(tmp_path) == ["s"]
    assert (tmp_path / "s" / "meta.json").read_text() == before
    open_store(tmp_path / "s")


def test_assignment_with_an_empty_part_is_refused(tmp_path):
    ds = undirected_toy()
    with pytest.raises(ConfigError, match="leaves part 1 of 3 empty"):
        write_store(ds, np.array([0, 0, 0, 2, 2, 2, 0, 0, 2]), tmp_path / "s", method="random", seed=0)
    with pytest.raises(ConfigError, match=r"shape \(9,\)"):
        write_store(ds, np.zeros(8, dtype=np.int64), tmp_path / "s", method="random", seed=0)
    assert os.listdir(tmp_path) == []


def test_load_part_out_of_range(cora_store):
    with pytest.raises(StoreError, match="has parts 0..3, not part 4"):
        open_store(cora_store).load_part(4)


def test_stats_of_a_path_by_hand(tmp_path):
    # Path 0-1-2-3-4, contiguous into [0,1,2] and [3,4]: self-loops plus in-edges 0<-1, 1<-0,
    # 1<-2, 2<-1, 2<-3 | 3<-2, 3<-4, 4<-3; entries 2<-3 and 3<-2 are cut.
    ds = make_dataset(5, [0, 1, 2, 3], [1, 2, 3, 4])
    parts = assign_parts(5, ds.src, ds.dst, 2, "contiguous")
    assert parts.tolist() == [0, 0, 0, 1, 1]
    write_store(ds, parts, tmp_path / "s", method="contiguous", seed=0)
    stats = partition_stats(open_store(tmp_path / "s"))
    assert stats["parts"] == [
        {"part": 0, "owned": 3, "nnz": 3 + 5, "cut": 1, "ghosts": 1, "ghost_ratio": 1 / 3, "send": 1},
        {"part": 1, "owned": 2, "nnz": 2 + 3, "cut": 1, "ghosts": 1, "ghost_ratio": 0.5, "send": 1},
    ]
    g = stats["global"]
    assert (g["edge_cut"], g["edges"], g["edge_cut_fraction"], g["balance"]) == (2, 8, 0.25, 3 / 2.5)
    assert g["edge_balance"] == pytest.approx(8 / 6.5)  # in-edges with self loops: 8 and 5
    table = format_stats(stats)
    assert "edge cut: 2 of 8 edges (25.00%); balance (max/mean owned): 1.200, of in-edges: 1.231" in table
    assert table.splitlines()[0].split() == ["part", "owned", "in-edges", "cut", "in-edges", "ghosts", "ghosts/owned", "send", "rows"]


@pytest.mark.parametrize("method", METHODS)
def test_store_stats_agree_with_assignment_stats(method, tmp_path):
    ds = load_cora()
    parts = assign_parts(ds.num_nodes, ds.src, ds.dst, 3, method, seed=2)
    write_store(ds, parts, tmp_path / "s", method=method, seed=2)
    from_store = partition_stats(open_store(tmp_path / "s"))
    assert from_store == partition_stats(parts, gcn_normalize(ds.src, ds.dst, ds.num_nodes))
    assert from_store["global"]["ghosts"] == from_store["global"]["send"]


# ----------------------------------------------------------------------------- sparse features


@pytest.fixture
def cora_sparse_store(tmp_path):
    """Cora (1.3% non-zero) in 3 parts; ``auto`` stores its features as CSR."""
    ds = load_cora()
    write_store(ds, assign_parts(ds.num_nodes, ds.src, ds.dst, 3, "metis"), tmp_path / "s", method="metis", seed=0)
    return tmp_path / "s"


def test_sparse_features_round_trip(cora_sparse_store):
    from dorylus.models.sparse import SparseRows

    ds = load_cora()
    store = open_store(cora_sparse_store)
    raw = json.loads((cora_sparse_store / "meta.json").read_text())
    assert raw["format_version"] == 3
    for i in range(3):
        entry = raw["parts"][i]
        part = store.load_part(i)
        assert entry["features"] == "csr" and store.meta.feature_layout(i) == "csr"
        assert isinstance(part.features, SparseRows) and part.features.nnz == entry["features_nnz"]
        assert part.features.indices.dtype == np.int32
        np.testing.assert_array_equal(part.features.toarray(), ds.features[part.owned])
        files = sorted(os.listdir(cora_sparse_store / f"part-{i}"))
        assert "features.npy" not in files and {"features_data.npy", "features_indices.npy",
                                                "features_indptr.npy"} <= set(files)
        assert sorted(rel.split("/")[1] for rel in store.meta.part_files(i)) == files
    back, _ = reassemble(store)
    assert np.array_equal(back.features, ds.features)


@pytest.mark.parametrize("mode, layout", [("auto", "dense"), ("on", "csr"), ("off", "dense")])
def test_sparse_features_option_on_dense_data(tmp_path, mode, layout):
    """The toy graph's features are all non-zero: ``auto`` keeps them dense, ``on`` forces CSR."""
    ds = undirected_toy()
    write_store(ds, assign_parts(9, ds.src, ds.dst, 2, "contiguous"), tmp_path / "s", method="contiguous", seed=0,
                sparse_features=mode)
    store = open_store(tmp_path / "s")
    assert store.meta.format_version == 3
    assert [store.meta.feature_layout(i) for i in range(2)] == [layout] * 2
    check_store(ds, assign_parts(9, ds.src, ds.dst, 2, "contiguous"), tmp_path / "s", dense_a_hat(ds))


def test_cora_auto_is_sparse_and_off_is_dense(tmp_path):
    ds = load_cora()
    parts = assign_parts(ds.num_nodes, ds.src, ds.dst, 2, "contiguous")
    for mode in ("auto", "off"):
        write_store(ds, parts, tmp_path / mode, method="contiguous", seed=0, sparse_features=mode)
    assert open_store(tmp_path / "auto").meta.feature_layout(0) == "csr"
    assert open_store(tmp_path / "off").meta.feature_layout(0) == "dense"
    size = lambda mode: sum(f.stat().st_size for f in (tmp_path / mode / "part-0").glob("features*.npy"))
    assert size("auto") * 10 < size("off")  # 8 bytes per non-zero at 1.3% density, 4 per entry dense


def test_unknown_sparse_features_mode_is_a_config_error(tmp_path):
    ds = undirected_toy()
    with pytest.raises(ConfigError, match="sparse_features must be one of auto, on, off, got 'yes'"):
        write_store(ds, np.zeros(9, dtype=np.int64), tmp_path / "s", method="contiguous", seed=0,
                    sparse_features="yes")
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize(
    "rel, make_bad, message",
    [
        ("part-1/features_indices.npy", lambda a: a + 10**4,
         r"part-1/features_indices.npy: columns must be in \[0, 1433\)"),
        ("part-1/features_indices.npy", lambda a: a.astype(np.int64), r"features_indices.npy has dtype int64"),
        ("part-0/features_indptr.npy", lambda a: a[::-1].copy(), r"part-0/features_indptr.npy: must rise from 0"),
        ("part-2/features_data.npy", lambda a: a[:-1], r"part-2/features_data.npy has dtype float32 shape"),
        ("part-2/features_indices.npy", lambda a: a[::-1].copy(),
         r"part-2/features_indices.npy: column indices must ascend strictly within each row"),
    ],
)
def test_inconsistent_sparse_features_are_named(cora_sparse_store, rel, make_bad, message):
    replace_array(cora_sparse_store, rel, make_bad(np.load(cora_sparse_store / rel)))
    store = open_store(cora_sparse_store)
    with pytest.raises(StoreError, match=message):
        store.load_part(int(rel.split("/")[0].split("-")[1]))


@pytest.mark.parametrize("change, message", [
    ({"features": "coo"}, r"parts\[1\] 'features' must be one of dense, csr"),
    ({"features_nnz": -1}, r"parts\[1\] has CSR features but no non-negative integer 'features_nnz'"),
])
def test_bad_layout_in_meta_is_named(cora_sparse_store, change, message):
    meta = json.loads((cora_sparse_store / "meta.json").read_text())
    meta["parts"][1].update(change)
    (cora_sparse_store / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(StoreError, match=message):
        open_store(cora_sparse_store)


def test_a_part_without_layout_is_refused(cora_sparse_store):
    meta = json.loads((cora_sparse_store / "meta.json").read_text())
    del meta["parts"][0]["features"]
    (cora_sparse_store / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(StoreError, match=r"parts\[0\] 'features' must be one of dense, csr, got None"):
        open_store(cora_sparse_store)


def test_inspect_prints_a_models_ghost_traffic(tmp_path, capsys):
    from dorylus.cli import main
    from dorylus.config import TrainConfig
    from dorylus.models import get_model
    from dorylus.models.spec import ModelSpec
    from dorylus.partition import partition_stats

    ds = undirected_toy()
    root = tmp_path / "store"
    write_store(ds, assign_parts(ds.num_nodes, ds.src, ds.dst, 2, "contiguous"), root, method="contiguous", seed=0)
    assert main(["inspect", str(root), "--model", "gat", "--hidden", "4", "--heads", "2"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    spec = ModelSpec.from_config(TrainConfig(model="gat", hidden=4, heads=2), ds.num_features, ds.num_classes)
    ghosts = partition_stats(open_store(root))["global"]["ghosts"]
    assert ghosts > 0
    expected = 4 * ghosts * get_model("gat").build_plan(spec).ghost_columns(True)
    assert line.startswith("gat (") and f"({expected:,} bytes) in the training pass" in line


@pytest.mark.parametrize("mode,layout", [("on", "csr"), ("off", "dense")])
def test_partition_command_takes_the_feature_layout(tmp_path, mode, layout):
    from dorylus.cli import main
    from dorylus.data.loaders import save_npz

    save_npz(undirected_toy(), tmp_path / "toy.npz")
    out = tmp_path / "store"
    assert main(["partition", "--dataset", str(tmp_path / "toy.npz"), "--parts", "2", "--method", "contiguous",
                 "--out", str(out), "--sparse-features", mode]) == 0
    meta = json.loads((out / "meta.json").read_text())
    assert [p.get("features") for p in meta["parts"]] == [layout, layout]
