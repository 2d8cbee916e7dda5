"""benchmarks/bench_gather.py's roofline compares the store's vertex orders (random, bfs, rcm)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import scipy.sparse

from dorylus.models import kernels
from dorylus.partition.store import locality_order
from tests.benchmarks import import_benchmark


@pytest.fixture(scope="module")
def bench():
    return import_benchmark("bench_gather")


def ring(bench, n=3000, degree=8, seed=1):
    rng = np.random.default_rng(seed)
    src, dst = bench.ring_graph(n, degree, rng, window=20, far=0.0)  # a long ring: ordered, a narrow band
    return bench.relabelled(src, dst, rng.permutation(n))


def bandwidth(g) -> float:
    return float(np.abs(np.repeat(np.arange(g.indptr.size - 1), np.diff(g.indptr)) - g.indices).mean())


def test_every_order_is_built_from_the_stores_order(bench):
    n = 3000
    src, dst = ring(bench, n)
    graphs, seconds = bench.ordered_graphs(src, dst, n)
    assert list(graphs) == ["random", "bfs", "rcm", "community"]
    assert seconds["random"] is None and all(seconds[name] >= 0 for name in ("bfs", "rcm", "community"))
    indptr, indices = bench.csr_from_pairs(dst, src, n, n)  # no self loops, as the store orders
    for name in ("bfs", "rcm", "community"):
        want = bench.ahat_lean(*bench.relabelled(src, dst, locality_order(indptr, indices, name)), n)
        np.testing.assert_array_equal(graphs[name].indptr, want.indptr)
        np.testing.assert_array_equal(graphs[name].indices, want.indices)
        assert bandwidth(graphs[name]) < bandwidth(graphs["random"]) / 4, name
    assert not np.array_equal(graphs["bfs"].indices, graphs["rcm"].indices)  # two orders, not one twice
    x = np.random.default_rng(2).standard_normal((n, 16), dtype=np.float32)
    for name, g in graphs.items():
        a = scipy.sparse.csr_matrix((np.repeat(g.row_scale.astype(np.float64), np.diff(g.indptr))
                                     * g.col_scale.astype(np.float64)[g.indices], g.indices, g.indptr), shape=(n, n))
        want = a @ x.astype(np.float64)
        got = kernels.gather(g.indptr, g.indices, x, row_scale=g.row_scale, col_scale=g.col_scale)
        assert np.abs(got - want).max() <= bench.RELATIVE_TOLERANCE * np.abs(want).max(), name


def test_roofline_rows_name_each_order(bench):
    rows = bench.bench_roofline(2000, 16, 8, 0, 1, np.random.default_rng(0))
    gathers = {r["order"]: r for r in rows if r["kernel"].endswith(": kernels.gather")}
    assert list(gathers) == ["random", "bfs", "rcm", "community"]
    for name, r in gathers.items():
        assert r["fraction_of_probe"] > 0 and r["mean_abs_i_minus_j"] > 0
        assert (r["order_seconds"] is None) == (name == "random")
    assert gathers["bfs"]["mean_abs_i_minus_j"] < gathers["random"]["mean_abs_i_minus_j"]


def test_orders_flag(bench, tmp_path, capsys):
    out = tmp_path / "gather.json"
    result = bench.main(["--roofline-only", "--roofline", "1500x16", "--orders", "bfs,random", "--repeats", "1",
                         "--warmup", "0", "--output", str(out)])
    assert json.loads(out.read_text())["roofline_orders"] == ["bfs", "random"]
    assert {r["order"] for r in result["roofline"]} == {"bfs", "random", None}  # None: the probe
    assert "fraction of the probe: bfs" in capsys.readouterr().out
    for bad in ("dfs", "random,none", ","):
        with pytest.raises(SystemExit) as exit_:
            bench.main(["--roofline-only", "--orders", bad])
        assert exit_.value.code == 2
        assert "--orders" in capsys.readouterr().err
