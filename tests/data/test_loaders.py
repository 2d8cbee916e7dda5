"""Tests for dorylus.data.loaders: every format, its round trips, and each kind of bad input."""

from __future__ import annotations

import gzip
import os
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from dorylus.data.graph import MASK_NAMES, GraphDataset
from dorylus.data.loaders import (
    DEFAULT_SPLIT_FRACTIONS,
    from_dgl,
    from_pyg,
    load_dataset,
    load_edgelist,
    load_npz,
    load_ogb,
    random_split,
    save_npz,
)
from dorylus.errors import DatasetError
from tests.graphs import oracle, shared_data


def small_arrays() -> dict:
    """A 6-vertex, 7-edge, 3-feature, 3-class graph with one unlabeled vertex (5)."""
    return dict(
        src=np.array([0, 1, 2, 3, 4, 5, 0], dtype=np.int64),
        dst=np.array([1, 2, 3, 4, 5, 0, 3], dtype=np.int64),
        features=np.arange(18, dtype=np.float32).reshape(6, 3) / 7.0,
        labels=np.array([0, 1, 2, 0, 1, -1], dtype=np.int64),
        train_mask=np.array([1, 1, 0, 0, 0, 0], dtype=bool),
        val_mask=np.array([0, 0, 1, 0, 0, 0], dtype=bool),
        test_mask=np.array([0, 0, 0, 1, 1, 0], dtype=bool),
    )


def small_dataset(**overrides) -> GraphDataset:
    fields = dict(name="tiny", num_classes=3, directed=False, **small_arrays())
    fields.update(overrides)
    return GraphDataset(**fields)


def assert_same(a: GraphDataset, b: GraphDataset) -> None:
    assert (a.name, a.num_classes, a.directed) == (b.name, b.num_classes, b.directed)
    for key in ("src", "dst", "features", "labels", *MASK_NAMES):
        x, y = getattr(a, key), getattr(b, key)
        assert x.dtype == y.dtype and x.shape == y.shape, key
        np.testing.assert_array_equal(x, y, err_msg=key)


def write_raw_npz(path: Path, **overrides) -> Path:
    """An archive written with np.savez directly (no validation), so it can be made bad."""
    arrays = small_arrays()
    arrays.update(overrides)
    np.savez(path, **{k: v for k, v in arrays.items() if v is not None})
    return path


# --------------------------------------------------------------------------------------------
# .npz


def test_save_load_npz_round_trip_is_exact(tmp_path):
    original = small_dataset(name="my graph", directed=True, num_classes=3)
    target = tmp_path / "g.npz"
    save_npz(original, target)
    assert_same(load_npz(target), original)
    save_npz(original, target, compress=True)  # overwriting an existing file is fine
    assert_same(load_npz(target), original)
    assert sorted(os.listdir(tmp_path)) == ["g.npz"]  # no temp file left behind


def test_load_npz_defaults_for_optional_keys(tmp_path):
    loaded = load_npz(write_raw_npz(tmp_path / "plain-graph.npz"))
    assert loaded.name == "plain-graph"
    assert loaded.num_classes == 3  # max label 2, plus one
    assert loaded.directed is False
    np.testing.assert_array_equal(loaded.src, small_arrays()["src"])


def test_load_npz_converts_to_canonical_dtypes(tmp_path):
    path = write_raw_npz(
        tmp_path / "g.npz",
        src=np.array([0, 1, 2, 3, 4, 5, 0], dtype=np.int32),
        features=np.ones((6, 3), dtype=np.float64),
        train_mask=np.array([1, 1, 0, 0, 0, 0], dtype=np.uint8),
    )
    loaded = load_npz(path)
    assert loaded.src.dtype == np.int64
    assert loaded.features.dtype == np.float32
    assert loaded.train_mask.dtype == np.bool_ and loaded.train_mask.sum() == 2


def test_save_npz_failure_keeps_previous_file_and_leaves_no_temp(tmp_path, monkeypatch):
    target = tmp_path / "g.npz"
    save_npz(small_dataset(), target)
    before = target.read_bytes()

    def broken_savez(file, **arrays):
        file.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(np, "savez", broken_savez)
    with pytest.raises(OSError, match="disk full"):
        save_npz(small_dataset(name="other"), target)
    assert target.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["g.npz"]


def test_save_npz_refuses_invalid_dataset_without_writing(tmp_path):
    bad = small_dataset(features=np.full((6, 3), np.nan, dtype=np.float32))
    with pytest.raises(DatasetError, match="NaN or inf"):
        save_npz(bad, tmp_path / "g.npz")
    assert os.listdir(tmp_path) == []


def test_save_npz_into_missing_directory(tmp_path):
    with pytest.raises(DatasetError, match="does not exist"):
        save_npz(small_dataset(), tmp_path / "nowhere" / "g.npz")


def test_load_npz_missing_file(tmp_path):
    path = tmp_path / "absent.npz"
    with pytest.raises(DatasetError, match="absent.npz.*not found"):
        load_npz(path)


def test_load_npz_missing_key_names_file_and_key(tmp_path):
    path = write_raw_npz(tmp_path / "nolabels.npz", labels=None)
    with pytest.raises(DatasetError, match=r"nolabels\.npz: missing key 'labels'"):
        load_npz(path)


def test_load_npz_garbage_bytes(tmp_path):
    path = tmp_path / "garbage.npz"
    path.write_bytes(np.random.default_rng(0).bytes(300).replace(b"PK", b"xx"))
    with pytest.raises(DatasetError, match=r"garbage\.npz: .*not a NumPy \.npz file"):
        load_npz(path)


def test_load_npz_truncated_archive(tmp_path):
    path = write_raw_npz(tmp_path / "cut.npz")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(DatasetError, match=r"cut\.npz: corrupt"):
        load_npz(path)


def test_load_npz_single_npy_array_is_not_an_archive(tmp_path):
    path = tmp_path / "array.npz"
    with open(path, "wb") as f:
        np.save(f, np.arange(3))
    with pytest.raises(DatasetError, match=r"array\.npz: .*got a single \.npy array"):
        load_npz(path)


def test_load_npz_non_scalar_num_classes(tmp_path):
    path = write_raw_npz(tmp_path / "g.npz", num_classes=np.array([3, 4]))
    with pytest.raises(DatasetError, match="'num_classes' must be a scalar"):
        load_npz(path)


@pytest.mark.parametrize(
    "overrides, problem",
    [
        (dict(dst=np.array([1, 2, 3, 4, 5, 0, 6])), "dst has vertex id 6 out of range"),
        (dict(src=np.array([0, -1, 2, 3, 4, 5, 0])), "src has vertex id -1 out of range"),
        (dict(dst=np.array([1, 2, 3])), "src and dst lengths differ: 7 vs 3"),
        (dict(labels=np.array([0, 1, 2, 0, 1])), r"labels must have shape \(6,\)"),
        (
            dict(features=np.array([[0, 1, 2]] * 5 + [[0, np.nan, 2]], dtype=np.float32)),
            "NaN or inf.*vertex 5, column 1",
        ),
        (dict(features=np.array([[np.inf, 1, 2]] * 6, dtype=np.float32)), "NaN or inf"),
        (dict(num_classes=np.int64(2)), "label 2 out of range"),
        (dict(num_classes=np.int64(6)), r"3 of 6 classes have no vertex: 3\.\.5"),
        (dict(labels=np.array([0, 1, 2, 0, 99, -1])), r"96 of 100 classes have no vertex: 3\.\.98"),
        (dict(features=np.zeros((6, 0), np.float32)), "features have 0 columns"),
        (dict(train_mask=np.zeros(6, dtype=bool)), "train_mask is empty"),
        (dict(test_mask=np.array([0, 0, 0, 0, 0, 1], dtype=bool)), "test_mask includes unlabeled"),
    ],
    ids=[
        "id-too-large", "id-negative", "src-dst-length", "features-labels-length",
        "nan-feature", "inf-feature", "label-out-of-range", "empty-class-given-c", "label-99-inferred-c",
        "zero-feature-columns", "empty-train", "unlabeled-in-mask",
    ],
)
def test_load_npz_rejects_bad_content_naming_file(tmp_path, overrides, problem):
    path = write_raw_npz(tmp_path / "bad.npz", **overrides)
    with pytest.raises(DatasetError, match=rf"bad\.npz: .*{problem}"):
        load_npz(path)


def test_cora_loads_with_known_statistics():
    cora = load_npz(shared_data("cora.npz"))
    assert (cora.num_nodes, cora.num_edges, cora.num_features, cora.num_classes) == (
        2708, 10556, 1433, 7,
    )
    assert (cora.train_mask.sum(), cora.val_mask.sum(), cora.test_mask.sum()) == (140, 500, 1000)
    assert cora.name == "cora" and cora.directed is False


# --------------------------------------------------------------------------------------------
# edge list


def write_edgelist_siblings(base: Path, split: bool = False) -> None:
    """Writes base.features.npy, base.labels.npy (and base.split.npz) for small_arrays()."""
    arrays = small_arrays()
    np.save(f"{base}.features.npy", arrays["features"])
    np.save(f"{base}.labels.npy", arrays["labels"])
    if split:
        np.savez(f"{base}.split.npz", **{m: arrays[m] for m in MASK_NAMES})


EDGE_TEXT = """# a comment line, then the 7 edges of small_arrays()
0 1
1\t2   # trailing comment

2,3
3 , 4
  4 5
5 0
0 3
"""


@pytest.mark.parametrize("suffix", [".edges", ".txt", ".tsv", ".csv"])
def test_edgelist_with_sibling_files_and_split(tmp_path, suffix):
    path = tmp_path / f"g{suffix}"
    path.write_text(EDGE_TEXT)
    write_edgelist_siblings(tmp_path / "g", split=True)
    loaded = load_edgelist(path)
    assert_same(loaded, small_dataset(name="g"))


def test_edgelist_explicit_paths_and_options(tmp_path):
    path = tmp_path / "edges.data"
    path.write_text(EDGE_TEXT)
    write_edgelist_siblings(tmp_path / "elsewhere", split=True)
    loaded = load_edgelist(
        path,
        features=tmp_path / "elsewhere.features.npy",
        labels=tmp_path / "elsewhere.labels.npy",
        split=tmp_path / "elsewhere.split.npz",
        num_classes=3,
        directed=True,
        name="named",
    )
    assert_same(loaded, small_dataset(name="named", num_classes=3, directed=True))


def test_edgelist_without_split_file_makes_seeded_random_split(tmp_path):
    n = 50
    labels = np.arange(n) % 4
    labels[[3, 17]] = -1
    np.save(tmp_path / "r.features.npy", np.ones((n, 2), dtype=np.float32))
    np.save(tmp_path / "r.labels.npy", labels)
    (tmp_path / "r.edges").write_text("0 1\n")
    first = load_edgelist(tmp_path / "r.edges")
    again = load_edgelist(tmp_path / "r.edges")
    other_seed = load_edgelist(tmp_path / "r.edges", seed=1)
    masks = np.stack([first.train_mask, first.val_mask, first.test_mask])
    assert (masks.sum(axis=0) == (labels >= 0)).all()  # disjoint, covers exactly the labeled
    assert masks.sum(axis=1).tolist() == [
        round(f * 48) for f in DEFAULT_SPLIT_FRACTIONS[:2]
    ] + [48 - sum(round(f * 48) for f in DEFAULT_SPLIT_FRACTIONS[:2])]
    np.testing.assert_array_equal(first.train_mask, again.train_mask)
    assert not np.array_equal(first.train_mask, other_seed.train_mask)


def test_random_split_gives_at_least_one_training_vertex():
    masks = random_split(np.array([-1, 2, -1]), seed=3)
    assert masks["train_mask"].tolist() == [False, True, False]
    assert not masks["val_mask"].any() and not masks["test_mask"].any()


def test_edgelist_windows_line_endings_and_no_final_newline(tmp_path):
    path = tmp_path / "w.txt"
    path.write_bytes(b"0 1\r\n1 2\r\n2 3\r\n3 4\r\n4 5\r\n5 0\r\n0 3")
    write_edgelist_siblings(tmp_path / "w", split=True)
    assert_same(load_edgelist(path), small_dataset(name="w"))
    path.write_bytes(b"0 1\r\n1,2\r\n\r\n2 x\r\n")
    with pytest.raises(DatasetError, match=r"w\.txt: line 4: 'x' is not an integer .*: '2 x'$"):
        load_edgelist(path)


def test_edgelist_empty_file_is_a_graph_without_edges(tmp_path):
    (tmp_path / "e.txt").write_text("# no edges\n\n")
    write_edgelist_siblings(tmp_path / "e", split=True)
    loaded = load_edgelist(tmp_path / "e.txt")
    assert loaded.num_edges == 0 and loaded.src.dtype == np.int64 and loaded.num_nodes == 6


@pytest.mark.parametrize(
    "text, line, problem",
    [
        ("0 1\n1 2\n2 3 4\n", 3, "expected 2 vertex ids"),
        ("0 1\n# c\n\n5\n", 4, "got 1 fields"),
        ("src dst\n0 1\n", 1, "'src' is not an integer"),
        ("0 1\n1 2.5\n", 2, "'2.5' is not an integer"),
        ("0 1\n1 99999999999999999999\n", 2, "is not an integer"),
    ],
    ids=["three-fields", "one-field", "header", "float", "overflow"],
)
def test_edgelist_malformed_line_names_file_and_line(tmp_path, text, line, problem):
    path = tmp_path / "bad.edges"
    path.write_text(text)
    write_edgelist_siblings(tmp_path / "bad")
    with pytest.raises(DatasetError, match=rf"bad\.edges: line {line}: .*{problem}"):
        load_edgelist(path)


def test_edgelist_id_out_of_range_names_file(tmp_path):
    (tmp_path / "g.edges").write_text("0 1\n1 6\n")
    write_edgelist_siblings(tmp_path / "g", split=True)
    with pytest.raises(DatasetError, match=r"g\.edges: dst has vertex id 6 out of range \[0, 6\)"):
        load_edgelist(tmp_path / "g.edges")


def test_edgelist_missing_files(tmp_path):
    with pytest.raises(DatasetError, match=r"none\.edges: edge list not found"):
        load_edgelist(tmp_path / "none.edges")
    (tmp_path / "g.edges").write_text("0 1\n")
    with pytest.raises(DatasetError, match=r"g\.features\.npy: features file not found"):
        load_edgelist(tmp_path / "g.edges")
    np.save(tmp_path / "g.features.npy", np.ones((6, 3), dtype=np.float32))
    with pytest.raises(DatasetError, match=r"g\.labels\.npy: labels file not found"):
        load_edgelist(tmp_path / "g.edges")
    with pytest.raises(DatasetError, match=r"x\.npy: labels file not found"):
        load_edgelist(tmp_path / "g.edges", labels=tmp_path / "x.npy")


def test_edgelist_bad_side_files(tmp_path):
    (tmp_path / "g.edges").write_text("0 1\n")
    write_edgelist_siblings(tmp_path / "g")
    (tmp_path / "g.features.npy").write_bytes(b"not numpy at all")
    with pytest.raises(DatasetError, match=r"g\.features\.npy: features file is not a NumPy"):
        load_edgelist(tmp_path / "g.edges")
    write_edgelist_siblings(tmp_path / "g")
    np.savez(tmp_path / "g.split.npz", train_mask=np.ones(6, dtype=bool))
    with pytest.raises(DatasetError, match=r"g\.split\.npz: split file is missing key val_mask"):
        load_edgelist(tmp_path / "g.edges")
    np.save(tmp_path / "g.labels.npy", np.array([0, 1, 2]))
    (tmp_path / "g.split.npz").unlink()
    with pytest.raises(DatasetError, match=r"g\.edges: labels must have shape \(6,\)"):
        load_edgelist(tmp_path / "g.edges")


# --------------------------------------------------------------------------------------------
# OGB


def write_gz_csv(path: Path, rows) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt") as f:
        for row in rows:
            f.write(",".join(str(v) for v in np.atleast_1d(row)) + "\n")


def make_ogb(root: Path, scheme: str = "time", num_node_list: bool = True) -> dict:
    """A tiny OGB-layout directory; vertex 5 is unlabeled (nan). Returns the arrays written."""
    arrays = small_arrays()
    raw = root / "raw"
    write_gz_csv(raw / "edge.csv.gz", np.stack([arrays["src"], arrays["dst"]], axis=1))
    write_gz_csv(raw / "node-feat.csv.gz", arrays["features"].tolist())
    write_gz_csv(raw / "node-label.csv.gz", ["0", "1", "2", "0", "1", "nan"])
    if num_node_list:
        write_gz_csv(raw / "num-node-list.csv.gz", [6])
    for mask, file_name in zip(MASK_NAMES, ("train", "valid", "test")):
        write_gz_csv(root / "split" / scheme / f"{file_name}.csv.gz", np.flatnonzero(arrays[mask]))
    (root / "mapping").mkdir()
    return arrays


def test_ogb_directory_loads_as_undirected_with_nan_labels_unlabeled(tmp_path):
    arrays = make_ogb(tmp_path / "ogbn_tiny")
    loaded = load_ogb(tmp_path / "ogbn_tiny")
    expected = small_dataset(name="ogbn-tiny")
    expected.features = np.array(arrays["features"].tolist(), dtype=np.float32)
    assert_same(loaded, expected)  # labels: nan -> -1; num_classes = max + 1 = 3
    assert load_ogb(tmp_path / "ogbn_tiny", directed=True).directed is True


def test_ogb_parent_directory_and_split_choice(tmp_path):
    make_ogb(tmp_path / "datasets" / "ogbn_tiny", scheme="sales_rank", num_node_list=False)
    (tmp_path / "datasets" / "ogbn_tiny.zip").write_bytes(b"ignored")
    assert load_ogb(tmp_path / "datasets").name == "ogbn-tiny"
    # a second scheme makes the choice ambiguous
    second = tmp_path / "datasets" / "ogbn_tiny" / "split" / "random"
    for file_name in ("train", "valid", "test"):
        write_gz_csv(second / f"{file_name}.csv.gz", [0] if file_name == "train" else [])
    with pytest.raises(DatasetError, match="expected exactly one split scheme.*random, sales_rank"):
        load_ogb(tmp_path / "datasets")
    picked = load_ogb(tmp_path / "datasets", split="random")
    assert picked.train_mask.tolist() == [True] + [False] * 5 and not picked.test_mask.any()
    with pytest.raises(DatasetError, match="no split scheme 'nope'"):
        load_ogb(tmp_path / "datasets", split="nope")


def test_ogb_parent_with_two_datasets_is_ambiguous(tmp_path):
    make_ogb(tmp_path / "ogbn_a")
    make_ogb(tmp_path / "ogbn_b")
    with pytest.raises(DatasetError, match="several OGB datasets.*ogbn_a, ogbn_b"):
        load_ogb(tmp_path)


def test_ogb_bad_inputs_name_the_file(tmp_path):
    root = tmp_path / "ogbn_tiny"
    make_ogb(root)
    (root / "raw" / "node-feat.csv.gz").unlink()
    with pytest.raises(DatasetError, match=r"node-feat\.csv\.gz: file not found"):
        load_ogb(root)
    make_ogb(tmp_path / "fresh")
    raw = tmp_path / "fresh" / "raw"
    write_gz_csv(raw / "num-node-list.csv.gz", [7])
    with pytest.raises(DatasetError, match=r"num-node-list\.csv\.gz: says 7 nodes but .* 6 rows"):
        load_ogb(tmp_path / "fresh")
    write_gz_csv(raw / "num-node-list.csv.gz", [6])
    write_gz_csv(tmp_path / "fresh" / "split" / "time" / "test.csv.gz", [3, 9])
    with pytest.raises(DatasetError, match=r"test\.csv\.gz: vertex id 9 out of range \[0, 6\)"):
        load_ogb(tmp_path / "fresh")
    write_gz_csv(tmp_path / "fresh" / "split" / "time" / "test.csv.gz", [3])
    (raw / "edge.csv.gz").write_bytes(b"not gzip")
    with pytest.raises(DatasetError, match=r"edge\.csv\.gz: cannot read as gzip CSV"):
        load_ogb(tmp_path / "fresh")
    write_gz_csv(raw / "edge.csv.gz", [[0, 1], [2, 6]])
    with pytest.raises(DatasetError, match=r"fresh: dst has vertex id 6 out of range"):
        load_ogb(tmp_path / "fresh")
    write_gz_csv(raw / "edge.csv.gz", [[0, 1]])
    write_gz_csv(raw / "node-label.csv.gz", [[0, 1]] * 6)
    with pytest.raises(DatasetError, match=r"node-label\.csv\.gz: .*multi-task"):
        load_ogb(tmp_path / "fresh")


def test_ogb_not_a_dataset_directory(tmp_path):
    with pytest.raises(DatasetError, match="not an OGB node-property dataset"):
        load_ogb(tmp_path)
    with pytest.raises(DatasetError, match="OGB dataset directory not found"):
        load_ogb(tmp_path / "missing")


# --------------------------------------------------------------------------------------------
# PyG and DGL


def test_from_pyg_round_trip():
    import torch  # a dependency

    data_module = oracle("torch_geometric.data", reason="from_pyg converts PyG's Data")
    arrays = small_arrays()
    data = data_module.Data(
        edge_index=torch.from_numpy(np.stack([arrays["src"], arrays["dst"]])),
        x=torch.from_numpy(arrays["features"]).requires_grad_(True),
        y=torch.from_numpy(arrays["labels"]).float().masked_fill(
            torch.from_numpy(arrays["labels"] < 0), float("nan")
        ).unsqueeze(1),  # [N, 1] float with NaN for the unlabeled vertex, as OGB's PyG data has
        **{m: torch.from_numpy(arrays[m]) for m in MASK_NAMES},
    )
    assert_same(from_pyg(data, name="tiny"), small_dataset())
    assert from_pyg(data, name="tiny", num_classes=3, directed=True).num_classes == 3
    with pytest.raises(DatasetError, match=r"2 of 5 classes have no vertex: 3\.\.4"):
        from_pyg(data, name="tiny", num_classes=5)


def test_from_pyg_missing_attribute_and_wrong_type():
    import torch  # a dependency

    data_module = oracle("torch_geometric.data", reason="from_pyg converts PyG's Data")
    data = data_module.Data(
        edge_index=torch.tensor([[0], [1]]), x=torch.ones(2, 1), y=torch.tensor([0, 1])
    )
    with pytest.raises(DatasetError, match="PyG Data 'g': missing attribute train_mask, val_mask"):
        from_pyg(data, name="g")
    with pytest.raises(DatasetError, match="expected a torch_geometric.data.Data, got dict"):
        from_pyg({"x": 1}, name="g")
    data.train_mask = data.val_mask = data.test_mask = torch.tensor([True, True])
    data.edge_index = torch.tensor([0, 1])
    with pytest.raises(DatasetError, match=r"edge_index must have shape \[2, E\]"):
        from_pyg(data, name="g")


def test_from_dgl_round_trip():
    dgl = pytest.importorskip("dgl", reason="dgl is not installed (optional extra dorylus[dgl])")
    import torch

    arrays = small_arrays()
    graph = dgl.graph(
        (torch.from_numpy(arrays["src"]), torch.from_numpy(arrays["dst"])), num_nodes=6
    )
    graph.ndata["feat"] = torch.from_numpy(arrays["features"])
    graph.ndata["label"] = torch.from_numpy(arrays["labels"])
    for mask in MASK_NAMES:
        graph.ndata[mask] = torch.from_numpy(arrays[mask])
    assert_same(from_dgl(graph, name="tiny"), small_dataset())
    del graph.ndata["label"]
    with pytest.raises(DatasetError, match="DGL graph 'tiny': missing ndata 'label'"):
        from_dgl(graph, name="tiny")


def test_from_dgl_without_dgl_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "dgl", None)  # makes `import dgl` fail
    with pytest.raises(DatasetError, match="from_dgl needs dgl"):
        from_dgl(object())


# --------------------------------------------------------------------------------------------
# load_dataset


@pytest.fixture
def fake_presets(monkeypatch):
    """A stand-in dorylus.data.synthetic with one preset, recording generate_preset calls."""
    module = types.ModuleType("dorylus.data.synthetic")
    module.calls = []
    module.preset_names = lambda: ["tiny-preset", "other"]

    def generate_preset(name: str, seed: int = 0) -> GraphDataset:
        module.calls.append((name, seed))
        return small_dataset(name=name)

    module.generate_preset = generate_preset
    monkeypatch.setitem(sys.modules, "dorylus.data.synthetic", module)
    return module


def test_load_dataset_preset(fake_presets):
    loaded = load_dataset("tiny-preset", seed=4)
    assert_same(loaded, small_dataset(name="tiny-preset"))
    assert fake_presets.calls == [("tiny-preset", 4)]
    assert load_dataset("tiny-preset", directed=True).directed is True


def test_load_dataset_dispatches_on_path_type(fake_presets, tmp_path):
    save_npz(small_dataset(directed=True), tmp_path / "g.npz")
    assert load_dataset(str(tmp_path / "g.npz")).directed is True
    assert load_dataset(tmp_path / "g.npz", directed=False).directed is False

    (tmp_path / "h.csv").write_text(EDGE_TEXT)
    write_edgelist_siblings(tmp_path / "h", split=True)
    assert_same(load_dataset(str(tmp_path / "h.csv")), small_dataset(name="h"))

    make_ogb(tmp_path / "ogb" / "ogbn_tiny")
    assert load_dataset(str(tmp_path / "ogb")).name == "ogbn-tiny"
    assert load_dataset(str(tmp_path / "ogb" / "ogbn_tiny"), directed=True).directed is True
    assert fake_presets.calls == []


def test_load_dataset_unknown_spec_lists_presets(fake_presets, tmp_path):
    missing = tmp_path / "nope.npz"
    with pytest.raises(
        DatasetError,
        match=r"dataset '.*nope\.npz' is neither a preset \(known: tiny-preset, other\) "
        "nor an existing path",
    ):
        load_dataset(str(missing))


def test_load_dataset_unsupported_types(fake_presets, tmp_path):
    (tmp_path / "graph.json").write_text("{}")
    with pytest.raises(DatasetError, match=r"graph\.json: unsupported dataset file type '\.json'"
                       r".*supported: .*\.npz.*\.edges.*OGB"):
        load_dataset(str(tmp_path / "graph.json"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DatasetError, match=r"empty: unsupported dataset directory"):
        load_dataset(str(tmp_path / "empty"))


def test_load_dataset_without_synthetic_module(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "dorylus.data.synthetic", None)
    with pytest.raises(DatasetError, match=r"neither a preset \(known: none\)"):
        load_dataset("cora-like")
    save_npz(small_dataset(), tmp_path / "g.npz")
    assert load_dataset(str(tmp_path / "g.npz")).name == "tiny"
