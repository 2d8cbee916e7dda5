"""The streamed generator (dataset directories written chunk by chunk) and the readers that map
or chunk datasets: reproducible, independent of the write chunk, exact sizes, memory-mapped."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from dorylus.data.graph import MASK_NAMES
from dorylus.data.loaders import (load_dataset, load_npz, open_edge_stream, read_row_range, row_blocks, save_npz,
                                  take_rows)
from dorylus.data.synthetic import STREAM_BLOCK_VERTICES, STREAMED_PRESETS, StreamedSpec, SyntheticSpec, write_streamed
from dorylus.errors import DatasetError

# Three source blocks (4096 vertices each) so that chunking has boundaries to move.
SPEC = StreamedSpec(SyntheticSpec(name="streamed-test", num_nodes=10_000, num_edges=120_000, num_features=8,
                                  num_classes=4, homophily=0.8, feature_snr=1.0, train_fraction=0.2,
                                  val_fraction=0.1, test_fraction=0.3), features="dense")
FILES = ("src.npy", "dst.npy", "features.npy", "labels.npy", *(f"{m}.npy" for m in MASK_NAMES), "meta.json")


def read_all(directory) -> dict[str, bytes]:
    return {name: (directory / name).read_bytes() for name in FILES}


def is_mapped(array: np.ndarray) -> bool:
    while array is not None:
        if isinstance(array, np.memmap) or isinstance(getattr(array, "base", None), np.memmap):
            return True
        array = getattr(array, "base", None)
        if not isinstance(array, np.ndarray):
            return isinstance(array, np.memmap) or type(array).__name__ == "mmap"
    return False


def test_exact_sizes_homophily_and_simple_symmetric_edges(tmp_path):
    meta = write_streamed(SPEC, tmp_path / "g", seed=1)
    src, dst = np.load(tmp_path / "g" / "src.npy"), np.load(tmp_path / "g" / "dst.npy")
    labels = np.load(tmp_path / "g" / "labels.npy")
    n, e, m = 10_000, 120_000, 60_000
    assert meta["num_edges"] == e and meta["symmetric"] and not meta["directed"]
    assert src.dtype == dst.dtype == np.int32 and src.shape == (e,)
    assert np.all(src[:m] < dst[:m])  # each pair drawn by its smaller endpoint, listed first that way
    np.testing.assert_array_equal(src[m:], dst[:m])
    np.testing.assert_array_equal(dst[m:], src[:m])
    keys = src[:m].astype(np.int64) * n + dst[:m]
    assert np.all(np.diff(keys) > 0)  # sorted by (u, v) and distinct
    same = np.count_nonzero(labels[src[:m]] == labels[dst[:m]])
    assert same == round(0.8 * m)  # edge homophily exact
    assert np.bincount(labels, minlength=4).min() > 0
    degree = np.bincount(src, minlength=n)
    assert degree.max() > 5 * degree.mean()  # heavy-tailed


def test_same_seed_same_bytes_other_seed_differs(tmp_path):
    write_streamed(SPEC, tmp_path / "a", seed=3)
    write_streamed(SPEC, tmp_path / "b", seed=3)
    write_streamed(SPEC, tmp_path / "c", seed=4)
    assert read_all(tmp_path / "a") == read_all(tmp_path / "b")
    assert read_all(tmp_path / "a")["src.npy"] != read_all(tmp_path / "c")["src.npy"]
    assert read_all(tmp_path / "a")["features.npy"] != read_all(tmp_path / "c")["features.npy"]


@pytest.mark.parametrize("chunk_vertices", [1, STREAM_BLOCK_VERTICES + 1, 10 ** 9])
def test_chunk_boundaries_do_not_change_the_output(tmp_path, chunk_vertices):
    write_streamed(SPEC, tmp_path / "default", seed=2)
    write_streamed(SPEC, tmp_path / "chunked", seed=2, chunk_vertices=chunk_vertices)
    assert read_all(tmp_path / "default") == read_all(tmp_path / "chunked")


def test_memory_mapped_load_and_chunked_stream_agree(tmp_path):
    write_streamed(SPEC, tmp_path / "g", seed=0)
    ds = load_dataset(tmp_path / "g")
    assert (ds.num_nodes, ds.num_edges, ds.num_features, ds.num_classes) == (10_000, 120_000, 8, 4)
    assert is_mapped(ds.features)  # not copied into memory
    assert ds.src.dtype == np.int64 and not ds.directed

    stream = open_edge_stream(tmp_path / "g")
    assert stream.symmetric and stream.num_edges == 120_000
    chunks = list(stream.chunks(7_001))
    assert max(s.size for s, _ in chunks) <= 7_001 and len(chunks) == -(-120_000 // 7_001)
    np.testing.assert_array_equal(np.concatenate([s for s, _ in chunks]), ds.src)
    np.testing.assert_array_equal(np.concatenate([d for _, d in chunks]), ds.dst)
    vertices = stream.vertex_data()
    assert is_mapped(vertices["features"])
    np.testing.assert_array_equal(vertices["labels"], ds.labels)


def test_features_carry_the_class(tmp_path):
    """Dense features: the nearest class centroid (estimated on the training vertices) predicts
    the test labels far above chance, so accuracy on these graphs means something."""
    write_streamed(dataclasses.replace(SPEC, features="dense"), tmp_path / "g", seed=0)
    ds = load_dataset(tmp_path / "g")
    x = np.asarray(ds.features)
    centroids = np.stack([x[ds.train_mask & (ds.labels == c)].mean(axis=0) for c in range(4)])
    predicted = np.argmin(((x[ds.test_mask, None, :] - centroids[None]) ** 2).sum(axis=2), axis=1)
    assert (predicted == ds.labels[ds.test_mask]).mean() > 0.5  # chance is about 0.25


def test_sparse_feature_kind_is_rectified(tmp_path):
    write_streamed(dataclasses.replace(SPEC, features="sparse"), tmp_path / "g", seed=0)
    x = np.load(tmp_path / "g" / "features.npy")
    assert x.min() >= 0.0 and 0.02 < (x > 0).mean() < 0.3


def test_refuses_a_non_empty_target_and_bad_arguments(tmp_path):
    target = tmp_path / "g"
    target.mkdir()
    (target / "keep.txt").write_text("x")
    with pytest.raises(DatasetError, match="not an empty directory"):
        write_streamed(SPEC, target)
    assert sorted(p.name for p in target.iterdir()) == ["keep.txt"]
    with pytest.raises(DatasetError, match="chunk_vertices"):
        write_streamed(SPEC, tmp_path / "h", chunk_vertices=0)
    with pytest.raises(DatasetError, match="unknown streamed preset"):
        write_streamed("synthetic-nope", tmp_path / "h")
    with pytest.raises(DatasetError, match="features must be"):
        StreamedSpec(SPEC.graph, features="bogus")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g"]  # nothing half-written


def test_streamed_preset_names_point_to_generate(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DatasetError, match="dorylus generate synthetic-10m --out DIR"):
        load_dataset("synthetic-10m")
    products = STREAMED_PRESETS["synthetic-products"].graph
    assert (products.num_nodes, products.num_edges, products.num_features, products.num_classes) == (
        2_400_000, 60_000_000, 100, 47)
    assert STREAMED_PRESETS["synthetic-250m"].graph.num_edges >= 250_000_000


def test_dataset_directory_meta_is_checked(tmp_path):
    write_streamed(SPEC, tmp_path / "g", seed=0)
    meta = json.loads((tmp_path / "g" / "meta.json").read_text())
    (tmp_path / "g" / "meta.json").write_text(json.dumps({**meta, "version": 99}))
    with pytest.raises(DatasetError, match="dataset version 99"):
        load_dataset(tmp_path / "g")
    (tmp_path / "g" / "meta.json").write_text(json.dumps({**meta, "num_edges": 5}))
    with pytest.raises(DatasetError, match="src.npy: edge sources has shape"):
        load_dataset(tmp_path / "g")


@pytest.mark.parametrize("compress", [False, True])
def test_npz_features_mapped_when_stored_and_edges_streamed_either_way(tmp_path, compress):
    write_streamed(SPEC, tmp_path / "g", seed=0)
    ds = load_dataset(tmp_path / "g")
    path = tmp_path / "g.npz"
    save_npz(ds, path, compress=compress)
    loaded = load_npz(path)
    assert is_mapped(loaded.features) == (not compress)  # deflate has no random access
    np.testing.assert_array_equal(np.asarray(loaded.features), np.asarray(ds.features))
    stream = open_edge_stream(path)
    chunks = list(stream.chunks(50_000))
    assert [s.size for s, _ in chunks] == [50_000, 50_000, 20_000]
    np.testing.assert_array_equal(np.concatenate([s for s, _ in chunks]), ds.src)
    np.testing.assert_array_equal(np.concatenate([d for _, d in chunks]), ds.dst)
    assert stream.num_edges == 120_000 and not stream.symmetric  # an archive promises nothing


def test_edge_list_streams_in_blocks_and_names_a_bad_line(tmp_path):
    rng = np.random.default_rng(0)
    src, dst = rng.integers(0, 50, 1000), rng.integers(0, 50, 1000)
    path = tmp_path / "g.edges"
    path.write_text("# comment\n" + "".join(f"{a} {b}\n" for a, b in zip(src, dst)))
    np.save(tmp_path / "g.features.npy", rng.random((50, 3), dtype=np.float32))
    np.save(tmp_path / "g.labels.npy", rng.integers(0, 2, 50))
    stream = open_edge_stream(path)
    assert stream.num_edges == -1 and stream.count_edges(100) == 1000
    chunks = list(stream.chunks(100))
    assert len(chunks) >= 10 and max(s.size for s, _ in chunks) <= 100
    np.testing.assert_array_equal(np.concatenate([s for s, _ in chunks]), src)
    np.testing.assert_array_equal(np.concatenate([d for _, d in chunks]), dst)
    with open(path, "a") as f:
        f.write("7 x\n")
    with pytest.raises(DatasetError, match=r"line 1002: 'x' is not an integer"):
        list(open_edge_stream(path).chunks(100))
    with open(path, "a") as f:
        f.write("7 99\n")
    path.write_text("1 2\n3 99\n")
    with pytest.raises(DatasetError, match=r"vertex id 99 out of range \[0, 50\)"):
        list(open_edge_stream(path).chunks(100))


@pytest.mark.parametrize("kind", ["directory", "npz", "npz-compressed", "edge list"])
def test_stream_fingerprint_is_the_loaded_datasets(tmp_path, kind):
    """A run started from a stream resumes against :func:`load_dataset` (or the reverse) only if
    both name the same data with the same digest."""
    write_streamed(SPEC, tmp_path / "g", seed=0)
    path = tmp_path / "g"
    if kind.startswith("npz"):
        path = tmp_path / "g.npz"
        save_npz(load_dataset(tmp_path / "g"), path, compress=kind == "npz-compressed")
    elif kind == "edge list":
        ds = load_dataset(tmp_path / "g")
        path = tmp_path / "e.edges"
        path.write_text("".join(f"{a} {b}\n" for a, b in zip(ds.src[:5000], ds.dst[:5000])))
        np.save(tmp_path / "e.features.npy", np.asarray(ds.features))
        np.save(tmp_path / "e.labels.npy", ds.labels)
    expected = load_dataset(path).fingerprint()
    assert open_edge_stream(path).fingerprint(chunk_edges=7_001) == expected
    other = tmp_path / "h"
    write_streamed(SPEC, other, seed=1)
    assert open_edge_stream(other).fingerprint() != load_dataset(tmp_path / "g").fingerprint()


def test_stream_fingerprint_refuses_non_finite_features(tmp_path):
    write_streamed(SPEC, tmp_path / "g", seed=0)
    features = np.load(tmp_path / "g" / "features.npy")
    features[9_321, 5] = np.nan
    np.save(tmp_path / "g" / "features.npy", features)
    with pytest.raises(DatasetError, match=r"features contain NaN or inf \(first at vertex 9321, column 5\)"):
        open_edge_stream(tmp_path / "g").fingerprint()


@pytest.mark.parametrize("block_bytes", [1, 100, 1 << 20])
def test_rows_of_a_mapped_matrix_read_by_plain_reads_equal_indexing(tmp_path, block_bytes):
    rng = np.random.default_rng(0)
    matrix = rng.random((1000, 7), dtype=np.float32)
    np.save(tmp_path / "m.npy", matrix)
    mapped = np.load(tmp_path / "m.npy", mmap_mode="r")
    for count in (0, 1, 37, 1000):
        rows = np.sort(rng.choice(1000, count, replace=False))
        np.testing.assert_array_equal(take_rows(mapped, rows, block_bytes), matrix[rows])
        np.testing.assert_array_equal(take_rows(matrix, rows, block_bytes), matrix[rows])
    blocks = list(row_blocks(mapped, block_bytes))
    assert [lo for lo, _ in blocks] == [lo for lo, _ in row_blocks(matrix, block_bytes)]
    np.testing.assert_array_equal(np.concatenate([b for _, b in blocks]), matrix)


def test_a_row_range_of_a_mapped_matrix_read_by_one_plain_read_equals_slicing(tmp_path):
    matrix = np.random.default_rng(1).random((300, 5), dtype=np.float32)
    np.save(tmp_path / "m.npy", matrix)
    mapped = np.load(tmp_path / "m.npy", mmap_mode="r")
    for start, stop in [(0, 300), (17, 18), (100, 250), (299, 300), (5, 5), (250, 100), (-10, None), (0, 10**6)]:
        for source in (mapped, matrix):
            got = read_row_range(source, start, stop)
            assert type(got) is np.ndarray and not np.shares_memory(got, matrix)
            np.testing.assert_array_equal(got, matrix[start:stop])
    (tmp_path / "m.npy").write_bytes((tmp_path / "m.npy").read_bytes()[:-40])  # truncated after mapping
    with pytest.raises(DatasetError, match="truncated"):
        read_row_range(mapped, 290, 300)
