r"""Seeded synthetic node-classification graphs: a degree-corrected stochastic block model.

Model (``N`` vertices, ``K`` classes = communities, ``M = E / 2`` undirected edges):

* Community sizes vary around ``N / K`` (Dirichlet proportions), every class non-empty; labels
  are the communities, assigned to vertex ids in random order.
* Each vertex gets a degree propensity :math:`\theta_v` from a Pareto law,
  :math:`P(\theta) \propto \theta^{-\gamma}` on :math:`\theta \ge 1` (``degree_exponent`` =
  :math:`\gamma`), capped at the structural cutoff :math:`\bar\theta \sqrt{N / \bar d}`
  (:math:`\bar d` the mean degree) so that no pair of vertices expects more than about one edge
  and deduplication does not flatten the tail. Expected degree is proportional to
  :math:`\theta_v`.
* Exactly ``round(homophily * M)`` pairs join two vertices of the same class (so ``homophily``
  is the edge homophily of the result) and the rest join different classes. Each pool is drawn
  the same way: vertex ``u`` originates :math:`\mathrm{Poisson}(\lambda \theta_u)` edges, whose
  other endpoint is drawn from ``u``'s own community (intra pool) or from the other communities
  (inter pool) with probability proportional to :math:`\theta`.
* Self-loops and duplicate pairs are dropped; each pool is topped up until it has enough
  distinct pairs and a uniformly random subset of exactly the pool's size is kept. (Drawing the
  class of each edge by a coin instead would let deduplication, which hits the denser
  intra-class pairs harder, pull homophily down: by 0.04 on ``synthetic-reddit``.) Every pair is
  stored both ways: ``src``/``dst`` are ``int64 [2M]``, the second half the reverse of the first.
* Features: :math:`x_v = \max(0, \mu_{y_v} + \varepsilon_v - \tau)`, ``float32 [N, F]``, with
  class centroids :math:`\mu_c \sim \mathcal N(0, s^2 I)` (``feature_snr`` = :math:`s`, the
  centroid scale in units of the noise), :math:`\varepsilon_v \sim \mathcal N(0, I)` and
  :math:`\tau = 1.5`, so about 7% of the entries are non-zero. Sparse and non-negative like
  bag-of-words counts: row normalization (the Kipf GCN recipe) is well defined, and it leaves the
  class differences large next to the part common to all rows, so Adam at lr 0.01 fits them in
  the recipe's 200 epochs (dense rectified Gaussians, ``tau = 0``, learn several times slower).
  With a small ``s`` one vertex's features say little about its class, while the average over
  its (mostly same-class) neighbours says much more, so a GCN clearly beats an MLP.
* Masks: a seeded random permutation split by ``train/val/test_fraction``.

Every random draw comes from a generator keyed by ``(seed, stream, pool, round, chunk)``, so equal
specs and seeds give bit-identical arrays. Memory stays near the size of the output: edges are
sampled in chunks of source vertices and kept as ``int64`` pair keys ``min * N + max``
(``N * N`` overflows ``int32``), features are drawn straight into the ``float32`` output.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

from dorylus.data.graph import GraphDataset
from dorylus.errors import DatasetError
from dorylus.normalize import sorted_unique

Progress = Callable[[str], None]

# Roughly this many sampled edges per chunk: ~4M edges keep a chunk's temporaries near 200 MB.
_CHUNK_EDGES = 1 << 22
_FEATURE_CHUNK_ROWS = 1 << 14
# tau of the feature model: P(N(0, 1) > 1.5) = 6.7% of entries non-zero without signal.
_FEATURE_THRESHOLD = 1.5
# Dirichlet concentration of the class proportions: sizes vary by about 1/sqrt(8) = 35%.
_CLASS_SIZE_CONCENTRATION = 8.0
# The first sampling round asks for this many times the target; top-ups ask more generously
# because the survival rate they extrapolate from falls as the graph fills up.
_OVERSAMPLE = 1.03
_TOPUP_OVERSAMPLE = 1.3
_MAX_ROUNDS = 8

# Independent random streams (the second entry of every generator's key).
_LABELS, _THETA, _COUNTS, _TARGETS, _TRIM, _CENTROIDS, _NOISE, _MASKS = range(8)


@dataclass(frozen=True)
class SyntheticSpec:
    """Parameters of a synthetic graph; see the module docstring for the model.

    Attributes:
        num_nodes: ``N``.
        num_edges: target number of *directed* edges ``E`` (even: each undirected edge is stored
            both ways); the generated graph has exactly this many.
        num_features: ``F``.
        num_classes: ``K`` (= communities).
        homophily: fraction of edges whose endpoints share a class, in ``[0, 1]`` (exact up to
            rounding to a whole number of edges).
        degree_exponent: power-law exponent ``gamma > 1`` of the degree propensities; smaller is
            more heterogeneous.
        feature_snr: class-centroid scale relative to the per-vertex feature noise (``>= 0``).
        train_fraction, val_fraction, test_fraction: split of the vertices (sum ``<= 1``).
        name: dataset name recorded in the :class:`GraphDataset`.
    """

    num_nodes: int
    num_edges: int
    num_features: int
    num_classes: int
    homophily: float = 0.65
    degree_exponent: float = 2.5
    feature_snr: float = 0.3
    train_fraction: float = 0.05
    val_fraction: float = 0.1
    test_fraction: float = 0.3
    name: str = "synthetic"

    def __post_init__(self) -> None:
        def fail(msg: str) -> None:
            raise DatasetError(f"synthetic spec {self.name!r}: {msg}")

        for field in ("num_nodes", "num_edges", "num_features", "num_classes"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                fail(f"{field} must be an integer, got {value!r}")
        n, k = self.num_nodes, self.num_classes
        if n < 2:
            fail(f"num_nodes must be at least 2, got {n}")
        if not 2 <= k <= n:
            fail(f"num_classes must be in [2, num_nodes={n}], got {k}")
        if self.num_features < 1:
            fail(f"num_features must be at least 1, got {self.num_features}")
        if self.num_edges < 0 or self.num_edges % 2:
            fail(f"num_edges counts both directions of each edge, so it must be even and >= 0, got {self.num_edges}")
        if self.num_edges > n * (n - 1):
            fail(f"num_edges={self.num_edges} exceeds {n * (n - 1)}, the complete graph on {n} nodes")
        if not 0.0 <= self.homophily <= 1.0:
            fail(f"homophily must be in [0, 1], got {self.homophily}")
        if not self.degree_exponent > 1.0:
            fail(f"degree_exponent must be > 1, got {self.degree_exponent}")
        if not self.feature_snr >= 0.0:
            fail(f"feature_snr must be >= 0, got {self.feature_snr}")
        fractions = (self.train_fraction, self.val_fraction, self.test_fraction)
        if not all(0.0 <= f <= 1.0 for f in fractions) or sum(fractions) > 1.0 + 1e-9:
            fail(f"train/val/test fractions must be in [0, 1] and sum to at most 1, got {fractions}")
        if round(self.train_fraction * n) < 1:
            fail(f"train_fraction={self.train_fraction} leaves no training vertex out of {n}")

    @property
    def mean_degree(self) -> float:
        """Mean (undirected) degree ``E / N``."""
        return self.num_edges / self.num_nodes


PRESETS: dict[str, SyntheticSpec] = {
    spec.name: spec
    for spec in (
        # Default dataset of the demo job: Planetoid-like 5% training labels. The Kipf GCN recipe
        # reaches 82-87% test accuracy (seed 0 data, three init seeds), the same model without
        # the graph (an MLP) 38%; chance is 10%.
        SyntheticSpec(
            name="synthetic-small", num_nodes=20_000, num_edges=300_000, num_features=128,
            num_classes=10, homophily=0.65, degree_exponent=2.5, feature_snr=0.3,
            train_fraction=0.05, val_fraction=0.1, test_fraction=0.3,
        ),
        # Benchmark size: ~1M directed edges.
        SyntheticSpec(
            name="synthetic-1m", num_nodes=64_000, num_edges=1_000_000, num_features=128,
            num_classes=16, homophily=0.65, degree_exponent=2.5, feature_snr=0.3,
            train_fraction=0.05, val_fraction=0.1, test_fraction=0.3,
        ),
        # Reddit's shape (PyG's Reddit: 232,965 vertices, 114,615,892 directed edges, 602
        # features, 41 classes, 153,431 / 23,831 / 55,703 train / val / test).
        SyntheticSpec(
            name="synthetic-reddit", num_nodes=232_965, num_edges=114_615_892, num_features=602,
            num_classes=41, homophily=0.7, degree_exponent=2.5, feature_snr=0.15,
            train_fraction=0.6586, val_fraction=0.1023, test_fraction=0.2391,
        ),
    )
}


def preset_names() -> list[str]:
    """Names of the built-in presets, sorted."""
    return sorted(PRESETS)


def generate_preset(name: str, seed: int = 0, progress: Progress | None = None) -> GraphDataset:
    """Generate the preset ``name``; an unknown name raises :class:`DatasetError` listing them."""
    if name not in PRESETS:
        raise DatasetError(f"unknown synthetic dataset {name!r}; known presets: {', '.join(preset_names())}")
    return generate(PRESETS[name], seed=seed, progress=progress)


def generate(spec: SyntheticSpec, seed: int = 0, progress: Progress | None = None) -> GraphDataset:
    """Sample the graph described by ``spec`` (see the module docstring).

    Args:
        spec: the model parameters.
        seed: non-negative int; equal ``(spec, seed)`` give bit-identical arrays.
        progress: optional callable receiving one-line status messages during long generation.

    Returns:
        A validated, undirected :class:`GraphDataset` with ``spec.num_nodes`` vertices and
        exactly ``spec.num_edges`` directed edges (every pair both ways, no self-loops).
    """
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise DatasetError(f"synthetic dataset {spec.name!r}: seed must be a non-negative integer, got {seed!r}")
    report = progress or (lambda message: None)

    def rng(*key: int) -> np.random.Generator:
        return np.random.Generator(np.random.PCG64(np.random.SeedSequence(int(seed), spawn_key=key)))

    n, k = spec.num_nodes, spec.num_classes
    proportions = rng(_LABELS).dirichlet(np.full(k, _CLASS_SIZE_CONCENTRATION))
    sizes = 1 + rng(_LABELS, 1).multinomial(n - k, proportions)
    labels = rng(_LABELS, 2).permutation(np.repeat(np.arange(k, dtype=np.int64), sizes))

    theta = _degree_propensities(rng(_THETA), n, spec.degree_exponent, spec.mean_degree)
    src, dst = _sample_edges(spec, labels, theta, rng, report)
    report(f"{spec.name}: features ({n} x {spec.num_features})")
    features = _class_features(spec, labels, rng)

    order = rng(_MASKS).permutation(n)
    n_train, n_val, n_test = (round(f * n) for f in (spec.train_fraction, spec.val_fraction, spec.test_fraction))
    n_test = min(n_test, n - n_train - n_val)  # rounding may overshoot by one
    masks = []
    for lo, hi in ((0, n_train), (n_train, n_train + n_val), (n_train + n_val, n_train + n_val + n_test)):
        mask = np.zeros(n, dtype=np.bool_)
        mask[order[lo:hi]] = True
        masks.append(mask)

    dataset = GraphDataset(
        name=spec.name, src=src, dst=dst, features=features, labels=labels,
        train_mask=masks[0], val_mask=masks[1], test_mask=masks[2], num_classes=k, directed=False,
    )
    return dataset.validate(f"synthetic dataset {spec.name!r}")


def _degree_propensities(rng: np.random.Generator, n: int, exponent: float, mean_degree: float) -> np.ndarray:
    """``float64 [N]`` Pareto(``exponent``) propensities on ``[1, inf)``, capped at the structural
    cutoff ``mean(theta) * sqrt(N / mean_degree)``."""
    theta = (1.0 - rng.random(n)) ** (-1.0 / (exponent - 1.0))
    ratio = math.sqrt(n / max(mean_degree, 1.0))
    raw = theta.copy()
    # The cap depends on the capped mean; a few fixed-point steps settle it.
    for _ in range(5):
        np.minimum(raw, max(1.0, ratio * theta.mean()), out=theta)
    return theta


def _sample_edges(
    spec: SyntheticSpec, labels: np.ndarray, theta: np.ndarray,
    rng: Callable[..., np.random.Generator], report: Progress,
) -> tuple[np.ndarray, np.ndarray]:
    """Sample ``M = spec.num_edges / 2`` distinct undirected pairs, ``round(homophily * M)`` of
    them inside a class; return them both ways as ``(src, dst)``, ``int64 [spec.num_edges]``."""
    n, target = spec.num_nodes, spec.num_edges // 2
    line = _Line.build(labels, theta, spec.num_classes)
    intra = round(spec.homophily * target)
    pools = []
    for pool, pool_target in enumerate((intra, target - intra)):

        def pool_rng(stream: int, *key: int, pool: int = pool) -> np.random.Generator:
            return rng(stream, pool, *key)

        pools.append(_sample_pool(spec, line, theta, pool == 0, pool_target, pool_rng, report))
    # Intra- and inter-class pairs are disjoint sets, so the two pools never share a pair.
    keys = np.concatenate(pools)
    del pools
    keys.sort(kind="stable")  # two sorted runs: a linear merge

    src = np.empty(2 * target, dtype=np.int64)
    dst = np.empty(2 * target, dtype=np.int64)
    np.floor_divide(keys, n, out=src[:target])
    np.multiply(src[:target], n, out=dst[:target])
    np.subtract(keys, dst[:target], out=dst[:target])
    del keys
    src[target:] = dst[:target]
    dst[target:] = src[:target]
    return src, dst


def _sample_pool(
    spec: SyntheticSpec, line: _Line, theta: np.ndarray, own: bool, target: int,
    rng: Callable[..., np.random.Generator], report: Progress,
) -> np.ndarray:
    """Exactly ``target`` distinct pair keys ``min * N + max`` (sorted ``int64``) of pairs inside
    (``own``) or across classes: every vertex ``u`` sources ``Poisson(lambda * theta_u)`` draws per
    round, and rounds repeat until enough distinct pairs exist; a random surplus is dropped."""
    kind = "intra-class" if own else "inter-class"
    keys = np.empty(0, dtype=np.int64)
    rounds, survival = 0, 1.0
    while keys.size < target:
        if rounds == _MAX_ROUNDS:
            fix = "lower num_edges or homophily" if own else "lower num_edges or raise homophily"
            raise DatasetError(
                f"synthetic spec {spec.name!r}: only {keys.size} distinct {kind} edges after {rounds} sampling "
                f"rounds, short of {target}; the graph is too dense for its communities ({fix})"
            )
        # Ask for the deficit, scaled up by the fraction of the last round's draws that were new
        # pairs (it falls as the graph fills up).
        wanted = (target - keys.size) / max(survival, 0.01) * (_OVERSAMPLE if rounds == 0 else _TOPUP_OVERSAMPLE)
        counts = rng(_COUNTS, rounds).poisson(theta * (wanted / line.total))
        fresh = _sample_round(
            line, counts, own, lambda chunk: rng(_TARGETS, rounds, chunk),
            lambda done: report(f"{spec.name}: {kind} edges, round {rounds + 1}, {done}/{line.labels.size} sources"),
        )
        before = keys.size
        keys = sorted_unique(np.concatenate((keys, fresh)) if keys.size else fresh, in_place=True)
        survival = (keys.size - before) / max(int(counts.sum()), 1)
        del fresh, counts
        rounds += 1
        report(f"{spec.name}: {keys.size} distinct {kind} edges after round {rounds} (target {target})")

    if keys.size > target:
        drop = rng(_TRIM).choice(keys.size, keys.size - target, replace=False)
        keep = np.ones(keys.size, dtype=np.bool_)
        keep[drop] = False
        keys = keys[keep]
    return keys


@dataclass
class _Line:
    """Vertices laid out by community on a line of length ``total = sum(theta)``: the vertex at
    position ``i`` covers ``[cum[i] - theta, cum[i])``, community ``c`` the segment
    ``[start[c], start[c] + mass[c])`` = positions ``first[c] .. first[c + 1] - 1``."""

    by_community: np.ndarray  # int64 [N]: vertex at each line position
    cum: np.ndarray  # float64 [N]: right end of each position's interval
    first: np.ndarray  # int64 [K + 1]
    start: np.ndarray  # float64 [K]
    mass: np.ndarray  # float64 [K]
    total: float
    labels: np.ndarray  # int64 [N]: community of each vertex

    @classmethod
    def build(cls, labels: np.ndarray, theta: np.ndarray, num_classes: int) -> "_Line":
        by_community = np.argsort(labels, kind="stable")
        cum = np.cumsum(theta[by_community])
        first = np.searchsorted(labels[by_community], np.arange(num_classes + 1))
        cum0 = np.concatenate(([0.0], cum))
        return cls(by_community, cum, first, cum0[first[:-1]], np.diff(cum0[first]), float(cum[-1]), labels)


def _sample_round(
    line: _Line, counts: np.ndarray, own: bool, chunk_rng: Callable[[int], np.random.Generator],
    sources_done: Callable[[int], None],
) -> np.ndarray:
    """Draw ``counts[u]`` edges from every source ``u``; return their ``min * N + max`` keys,
    ``int64``, self-loops removed (duplicates kept). ``sources_done(k)`` is called after each
    chunk with the number of sources done."""
    n = line.labels.size
    ends = np.cumsum(counts)
    # Chunk boundaries: whole source vertices, about _CHUNK_EDGES edges each.
    cuts = np.searchsorted(ends, np.arange(_CHUNK_EDGES, ends[-1], _CHUNK_EDGES))
    bounds = np.unique(np.concatenate(([0], cuts, [n])))
    keys = np.empty(int(ends[-1]), dtype=np.int64)
    filled = 0
    for chunk, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
        src = np.repeat(np.arange(lo, hi, dtype=np.int64), counts[lo:hi])
        dst = _sample_targets(line, line.labels[src], own, chunk_rng(chunk))
        pair_lo = np.minimum(src, dst)
        np.maximum(src, dst, out=dst)
        keep = pair_lo != dst
        m = int(keep.sum())
        # min * N + max: N * N can exceed int32, hence int64 throughout.
        np.add(pair_lo[keep] * n, dst[keep], out=keys[filled : filled + m])
        filled += m
        del src, dst, pair_lo, keep
        sources_done(int(hi))
    return keys[:filled]


def _sample_targets(line: _Line, community: np.ndarray, own: bool, rng: np.random.Generator) -> np.ndarray:
    """For sources in ``community`` (``int64 [m]``), draw the other endpoints (``int64 [m]``):
    inside the own community if ``own``, else outside it, with probability proportional to
    ``theta`` in both cases.

    A point ``x`` uniform on the own segment, or on the line with the own segment cut out, picks
    the vertex whose interval contains it.
    """
    seg_start, seg_mass = line.start[community], line.mass[community]
    first, end = line.first[community], line.first[community + 1]
    x = rng.random(community.size)
    if own:
        x *= seg_mass
        x += seg_start
        lo, hi = first, end - 1
    else:
        x *= line.total - seg_mass
        past = x >= seg_start
        x += np.where(past, seg_mass, 0.0)  # jump over the own segment
        lo, hi = np.where(past, end, 0), np.where(past, line.cum.size, first) - 1
    del seg_start, seg_mass
    pos = np.searchsorted(line.cum, x, side="right")
    # Float round-off at segment edges must not move a draw into or out of the own community.
    np.clip(pos, lo, hi, out=pos)
    return line.by_community[pos]


def _class_features(spec: SyntheticSpec, labels: np.ndarray, rng) -> np.ndarray:
    """``float32 [N, F]``: ``max(0, centroid[label] + noise - tau)``, drawn in row chunks straight
    into the output so no float64 ``N x F`` array ever exists."""
    n, f = spec.num_nodes, spec.num_features
    centroids = rng(_CENTROIDS).standard_normal((spec.num_classes, f), dtype=np.float32)
    centroids *= np.float32(spec.feature_snr)
    centroids -= np.float32(_FEATURE_THRESHOLD)
    features = np.empty((n, f), dtype=np.float32)
    for chunk, lo in enumerate(range(0, n, _FEATURE_CHUNK_ROWS)):
        block = features[lo : lo + _FEATURE_CHUNK_ROWS]
        rng(_NOISE, chunk).standard_normal(block.shape, dtype=np.float32, out=block)
        block += centroids[labels[lo : lo + _FEATURE_CHUNK_ROWS]]
        np.maximum(block, 0.0, out=block)
    return features


# --------------------------------------------------------------------------------------------
# Streamed generation to disk: graphs larger than what one process should hold.

r"""(Section docstring, kept next to the code it describes.)

Streamed model (:func:`write_streamed`), a Chung-Lu stochastic block model whose pairs are drawn
per block of source vertices so that no step needs the whole edge set:

* Labels, propensities :math:`\theta` (same laws as above) and masks are per-vertex arrays,
  ``O(N)`` memory.
* Every undirected pair :math:`\{u, v\}`, :math:`u < v`, is drawn only by its smaller endpoint
  ``u``: ``u`` originates :math:`\mathrm{Poisson}(\lambda_p \theta_u W_p(u))` draws in pool ``p``
  (intra- or inter-class), each picking ``v > u`` with probability :math:`\theta_v / W_p(u)`,
  where :math:`W_p(u)` is the :math:`\theta`-mass of the eligible ``v`` (same class, or other
  class, and ``v > u``). A pair is therefore drawn :math:`\mathrm{Poisson}(\lambda_p \theta_u
  \theta_v)` times whichever endpoint is smaller: the Chung-Lu law, and expected degree
  :math:`\propto \theta`. Because all pairs of ``u`` come from ``u``'s block, deduplicating inside
  a block is deduplicating globally.
* Pool ``p``'s exact pair count ``round(homophily * M)`` (resp. the rest) is apportioned over
  blocks of :data:`STREAM_BLOCK_VERTICES` consecutive sources in proportion to their expected
  draws :math:`\sum_{u \in b} \theta_u W_p(u)` (largest remainders); each block draws, tops up
  and trims to its own count. So ``E`` and the edge homophily are exact.
* Every random draw is keyed by ``(seed, stream, block, ...)``, never by the write chunk: how many
  blocks are written at a time (``chunk_vertices``) changes memory, not one byte of the output.
* Features: ``sparse`` as above (rectified, ~7% non-zero), or ``dense`` :math:`x_v =
  \mu_{y_v} + \varepsilon_v` (ogbn-products-like dense float32 rows; no rectification).

On disk (a *dataset directory*, read by :func:`dorylus.data.loaders.load_dataset_dir`): the
first ``M`` entries of ``src``/``dst`` are the pairs ``u < v`` sorted by ``(u, v)``, the last
``M`` the same pairs reversed, like :func:`generate`'s arrays.
"""

import json as _json
import os as _os
import shutil as _shutil
from dataclasses import asdict as _asdict
from pathlib import Path as _Path

from dorylus import atomic as _atomic

# Sources per block: the unit of the streamed generator's random keys and pair targets. Fixed,
# so the output never depends on the write chunk. 4096 keeps a block's draws at ~100K pairs for
# mean degree 50, cheap next to numpy's per-call overhead.
STREAM_BLOCK_VERTICES = 4096
# Write chunk (memory, not output): about this many pairs drawn per chunk.
_STREAM_CHUNK_PAIRS = 1 << 22
# A rejected inter-class draw (same class as its source) is redrawn at most this many times.
_REJECT_ROUNDS = 64
DATASET_FORMAT = "dorylus-dataset"
DATASET_VERSION = 1
DATASET_META = "meta.json"
_STREAMED_LABELS, _STREAMED_PAIRS = 8, 9  # more streams, after _MASKS


@dataclass(frozen=True)
class StreamedSpec:
    """A :class:`SyntheticSpec` plus the feature kind, for :func:`write_streamed`.

    Attributes:
        graph: sizes and model parameters (``num_edges`` directed, even).
        features: ``"sparse"`` (rectified class-centroid model, ~7% non-zero) or ``"dense"``
            (``mu_y + noise``, every entry non-zero).
    """

    graph: SyntheticSpec
    features: str = "dense"

    def __post_init__(self) -> None:
        if self.features not in ("dense", "sparse"):
            raise DatasetError(f"streamed spec {self.graph.name!r}: features must be 'dense' or 'sparse', "
                               f"got {self.features!r}")

    @property
    def name(self) -> str:
        return self.graph.name


STREAMED_PRESETS: dict[str, StreamedSpec] = {
    s.name: s
    for s in (
        # ~10M directed edges: the development size of the scale benchmark (products' shape, 1/6).
        StreamedSpec(SyntheticSpec(
            name="synthetic-10m", num_nodes=400_000, num_edges=10_000_000, num_features=100,
            num_classes=47, homophily=0.75, degree_exponent=2.5, feature_snr=0.5,
            train_fraction=0.1, val_fraction=0.02, test_fraction=0.88,
        ), features="dense"),
        # ogbn-products' shape (2,449,029 vertices, 100 dense features, 47 classes, 8% / 1.6% /
        # 90% split) at 60M directed edges, the size the scale issue measured.
        StreamedSpec(SyntheticSpec(
            name="synthetic-products", num_nodes=2_400_000, num_edges=60_000_000, num_features=100,
            num_classes=47, homophily=0.75, degree_exponent=2.5, feature_snr=0.5,
            train_fraction=0.08, val_fraction=0.016, test_fraction=0.9,
        ), features="dense"),
        # 250M directed edges: the largest graph meant to be made, partitioned and trained on a
        # 24 GB machine. Narrow features keep the vertex side (4M x 32 x 4 B = 0.5 GB) small next
        # to the edges (2 GB of int32 ids).
        StreamedSpec(SyntheticSpec(
            name="synthetic-250m", num_nodes=4_000_000, num_edges=250_000_000, num_features=32,
            num_classes=32, homophily=0.75, degree_exponent=2.5, feature_snr=0.5,
            train_fraction=0.1, val_fraction=0.02, test_fraction=0.2,
        ), features="dense"),
    )
}


def streamed_preset_names() -> list[str]:
    """Names of the presets generated to disk by :func:`write_streamed`, sorted."""
    return sorted(STREAMED_PRESETS)


def _apportion(total: int, weights: np.ndarray) -> np.ndarray:
    """``int64`` counts summing to exactly ``total``, proportional to ``weights`` (largest
    remainders; ties to the lower index, so the result is deterministic)."""
    weights = np.asarray(weights, dtype=np.float64)
    if total == 0 or weights.sum() <= 0:
        out = np.zeros(weights.size, dtype=np.int64)
        if total:
            raise DatasetError(f"cannot place {total} pairs: no block has eligible targets")
        return out
    exact = weights * (total / weights.sum())
    counts = np.floor(exact).astype(np.int64)
    short = total - int(counts.sum())
    if short:
        counts[np.argsort(-(exact - counts), kind="stable")[:short]] += 1
    return counts


@dataclass
class _StreamModel:
    """Per-vertex state of the streamed model (all ``[N]``): ``labels``; ``theta``; ``cum_id``
    (prefix sums of theta by id: v's interval is ``[cum_id[v] - theta_v, cum_id[v])``); the line
    by (class, id) as in :class:`_Line` (``by_class``, ``cum_line``, ``pos`` = u's position,
    ``seg_end`` = right end of each class' segment, ``last`` = its last position); and the
    eligible masses ``w_intra``/``w_inter`` of the module section's :math:`W_p(u)`."""

    labels: np.ndarray
    theta: np.ndarray
    cum_id: np.ndarray
    by_class: np.ndarray
    cum_line: np.ndarray
    pos: np.ndarray
    seg_end: np.ndarray
    last: np.ndarray
    w_intra: np.ndarray
    w_inter: np.ndarray

    @classmethod
    def build(cls, labels: np.ndarray, theta: np.ndarray, k: int) -> "_StreamModel":
        n = labels.size
        cum_id = np.cumsum(theta)
        by_class = np.argsort(labels, kind="stable")  # by class, then id (stable)
        cum_line = np.cumsum(theta[by_class])
        pos = np.empty(n, dtype=np.int64)
        pos[by_class] = np.arange(n, dtype=np.int64)
        first = np.searchsorted(labels[by_class], np.arange(k + 1))
        last = first[1:] - 1
        seg_end = cum_line[last]
        # Mass of same-class vertices above u: from u's right end to its class' right end.
        w_intra = seg_end[labels] - cum_line[pos]
        w_inter = (cum_id[-1] - cum_id) - w_intra
        # Round-off leaves crumbs where nothing is eligible (the top ids of a class).
        tiny = 1e-9 * cum_id[-1]
        w_intra[w_intra < tiny] = 0.0
        w_inter[w_inter < tiny] = 0.0
        return cls(labels, theta, cum_id, by_class, cum_line, pos, seg_end, last, w_intra, w_inter)

    def draw(self, u: np.ndarray, own: bool, rng: np.random.Generator) -> np.ndarray:
        """A target ``v > u`` per source in ``u`` (``int64``), with probability ``theta_v /
        W(u)`` over the pool's eligible vertices; ``-1`` where rejection sampling gave up."""
        if own:
            c = self.labels[u]
            x = self.cum_line[self.pos[u]] + rng.random(u.size) * (self.seg_end[c] - self.cum_line[self.pos[u]])
            at = np.searchsorted(self.cum_line, x, side="right")
            np.clip(at, self.pos[u] + 1, self.last[c], out=at)
            return self.by_class[at]
        n = self.cum_id.size
        v = np.full(u.size, -1, dtype=np.int64)
        todo = np.arange(u.size)
        for _ in range(_REJECT_ROUNDS):
            lo = self.cum_id[u[todo]]
            x = lo + rng.random(todo.size) * (self.cum_id[-1] - lo)
            cand = np.searchsorted(self.cum_id, x, side="right")
            np.clip(cand, u[todo] + 1, n - 1, out=cand)
            ok = self.labels[cand] != self.labels[u[todo]]
            v[todo[ok]] = cand[ok]
            todo = todo[~ok]
            if not todo.size:
                break
        return v


def _block_pairs(
    model: _StreamModel, lo: int, hi: int, own: bool, target: int, rng: Callable[..., np.random.Generator],
    name: str,
) -> np.ndarray:
    """Exactly ``target`` distinct keys ``u * N + v`` (sorted ``int64``, ``lo <= u < hi``,
    ``u < v``) of one pool: Poisson draws per source, topped up and trimmed."""
    n = model.labels.size
    weight = model.theta[lo:hi] * (model.w_intra if own else model.w_inter)[lo:hi]
    total = weight.sum()
    keys = np.empty(0, dtype=np.int64)
    survival = 1.0
    for rounds in range(_MAX_ROUNDS):
        if keys.size >= target:
            break
        wanted = (target - keys.size) / max(survival, 0.01) * (_OVERSAMPLE if rounds == 0 else _TOPUP_OVERSAMPLE)
        counts = rng(0, rounds).poisson(weight * (wanted / total))
        u = np.repeat(np.arange(lo, hi, dtype=np.int64), counts)
        v = model.draw(u, own, rng(1, rounds))
        fresh = u[v >= 0] * n + v[v >= 0]
        before = keys.size
        keys = sorted_unique(np.concatenate((keys, fresh)), in_place=True)
        survival = (keys.size - before) / max(u.size, 1)
    if keys.size < target:
        kind = "intra-class" if own else "inter-class"
        raise DatasetError(
            f"streamed spec {name!r}: sources {lo}..{hi - 1} reached only {keys.size} distinct {kind} pairs of "
            f"{target} after {_MAX_ROUNDS} rounds; the graph is too dense for its communities (lower num_edges)"
        )
    if keys.size > target:
        keep = np.ones(keys.size, dtype=np.bool_)
        keep[rng(2).choice(keys.size, keys.size - target, replace=False)] = False
        keys = keys[keep]
    return keys


def _write_npy_header(f, dtype: np.dtype, shape: tuple[int, ...]) -> int:
    """Write a ``.npy`` v1 header for a C-ordered array; return its length (data starts there)."""
    header = {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)), "fortran_order": False, "shape": shape}
    np.lib.format.write_array_header_1_0(f, header)
    return f.tell()


class _NpyOut:
    """A ``.npy`` file of known dtype and shape, written region by region with plain writes
    (``seek`` + ``tofile``): a memory map would count every written page in the writer's RSS."""

    def __init__(self, path: _Path, dtype, shape: tuple[int, ...]):
        self.dtype = np.dtype(dtype)
        self.row = int(np.prod(shape[1:], dtype=np.int64)) * self.dtype.itemsize
        self.f = open(path, "wb")
        self.offset = _write_npy_header(self.f, self.dtype, shape)
        self.f.truncate(self.offset + shape[0] * self.row)

    def write(self, at: int, array: np.ndarray) -> None:
        self.f.seek(self.offset + at * self.row)
        np.ascontiguousarray(array, dtype=self.dtype).tofile(self.f)

    def close(self) -> None:
        self.f.close()


def ids_dtype(num_nodes: int) -> np.dtype:
    """``int32`` when every id fits (``N <= 2^31``), else ``int64``: 4 bytes per stored id."""
    return np.dtype(np.int32) if num_nodes <= np.iinfo(np.int32).max + 1 else np.dtype(np.int64)


def write_streamed(
    spec: StreamedSpec | str, out: str | _os.PathLike, *, seed: int = 0, chunk_vertices: int | None = None,
    overwrite: bool = False, progress: Progress | None = None,
) -> dict:
    """Generate ``spec`` (a :class:`StreamedSpec` or a name in :data:`STREAMED_PRESETS`) into the
    dataset directory ``out`` without holding its edges (see the section docstring above).

    Memory: ``O(N)`` per-vertex arrays (about 80 bytes per vertex) plus one write chunk of
    ``chunk_vertices`` sources' pairs (default: about 4M pairs, ~200 MB of temporaries). Output
    bytes do not depend on ``chunk_vertices``.

    Files (``E`` directed edges, ids ``int32`` when ``N <= 2^31``): ``src.npy``, ``dst.npy``
    ``[E]``; ``features.npy`` ``float32 [N, F]``; ``labels.npy`` ``int32 [N]``;
    ``train_mask.npy``/``val_mask.npy``/``test_mask.npy`` ``bool [N]``; ``meta.json``. Written
    into a temporary directory beside ``out``, renamed into place when complete.

    Returns:
        The ``meta.json`` contents.
    """
    if isinstance(spec, str):
        if spec not in STREAMED_PRESETS:
            raise DatasetError(f"unknown streamed preset {spec!r}; known: {', '.join(streamed_preset_names())}")
        spec = STREAMED_PRESETS[spec]
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise DatasetError(f"streamed dataset {spec.name!r}: seed must be a non-negative integer, got {seed!r}")
    if chunk_vertices is not None and (isinstance(chunk_vertices, bool) or int(chunk_vertices) < 1):
        raise DatasetError(f"chunk_vertices must be a positive integer, got {chunk_vertices!r}")
    out = _Path(out)
    if out.exists() and not overwrite and (not out.is_dir() or any(out.iterdir())):
        raise DatasetError(f"{out}: exists and is not an empty directory (pass overwrite to replace it)")
    if not out.parent.is_dir():
        raise DatasetError(f"{out}: parent directory {out.parent} does not exist")
    report = progress or (lambda message: None)
    g = spec.graph
    n, k, m = g.num_nodes, g.num_classes, g.num_edges // 2

    def rng(*key: int) -> np.random.Generator:
        return np.random.Generator(np.random.PCG64(np.random.SeedSequence(int(seed), spawn_key=key)))

    proportions = rng(_LABELS).dirichlet(np.full(k, _CLASS_SIZE_CONCENTRATION))
    sizes = 1 + rng(_LABELS, 1).multinomial(n - k, proportions)
    labels = rng(_LABELS, 2).permutation(np.repeat(np.arange(k, dtype=np.int32), sizes))
    theta = _degree_propensities(rng(_THETA), n, g.degree_exponent, g.mean_degree)
    model = _StreamModel.build(labels, theta, k)
    del theta

    block = STREAM_BLOCK_VERTICES
    starts = np.arange(0, n, block)
    intra = round(g.homophily * m)
    targets = []
    for own, pool_total in ((True, intra), (False, m - intra)):
        w = model.theta * (model.w_intra if own else model.w_inter)
        targets.append(_apportion(pool_total, np.add.reduceat(w, starts)))
        del w
    block_pairs = targets[0] + targets[1]
    pair_start = np.concatenate(([0], np.cumsum(block_pairs)))
    if chunk_vertices is None:
        per_block = max(1.0, m / max(starts.size, 1))
        chunk_blocks = max(1, int(_STREAM_CHUNK_PAIRS // per_block))
    else:
        chunk_blocks = max(1, -(-int(chunk_vertices) // block))

    tmp = _atomic.temp_dir_beside(out, mode=0o755)
    try:
        ids = ids_dtype(n)
        src_out, dst_out = _NpyOut(tmp / "src.npy", ids, (2 * m,)), _NpyOut(tmp / "dst.npy", ids, (2 * m,))
        for c0 in range(0, starts.size, chunk_blocks):
            keys = []
            for b in range(c0, min(c0 + chunk_blocks, starts.size)):
                lo, hi = int(starts[b]), min(int(starts[b]) + block, n)
                pools = [
                    _block_pairs(model, lo, hi, own, int(targets[p][b]),
                                 lambda *key, b=b, p=p: rng(_STREAMED_PAIRS, b, p, *key), g.name)
                    for p, own in enumerate((True, False))
                ]
                keys.append(np.sort(np.concatenate(pools)))
            keys = np.concatenate(keys)
            u, v = np.divmod(keys, n)
            del keys
            at = int(pair_start[c0])
            src_out.write(at, u)
            dst_out.write(at, v)
            src_out.write(m + at, v)
            dst_out.write(m + at, u)
            del u, v
            report(f"{g.name}: edges of sources 0..{min(int(starts[min(c0 + chunk_blocks, starts.size) - 1]) + block, n)} "
                   f"of {n} ({2 * int(pair_start[min(c0 + chunk_blocks, starts.size)]):,} of {2 * m:,} edges)")
        src_out.close()
        dst_out.close()
        del model

        report(f"{g.name}: features ({n} x {g.num_features}, {spec.features})")
        centroids = rng(_CENTROIDS).standard_normal((k, g.num_features), dtype=np.float32)
        centroids *= np.float32(g.feature_snr)
        if spec.features == "sparse":
            centroids -= np.float32(_FEATURE_THRESHOLD)
        feat_out = _NpyOut(tmp / "features.npy", np.float32, (n, g.num_features))
        # Whole blocks per feature chunk, at most ~64 MB of rows (or the edge chunk's blocks if fewer).
        rows = block * max(1, min(chunk_blocks, (64 << 20) // (4 * g.num_features * block)))
        for lo in range(0, n, rows):
            hi = min(lo + rows, n)
            x = np.empty((hi - lo, g.num_features), dtype=np.float32)
            for b0 in range(lo, hi, block):  # one noise stream per block: chunking never changes it
                part = x[b0 - lo : min(b0 + block, hi) - lo]
                rng(_NOISE, b0 // block).standard_normal(part.shape, dtype=np.float32, out=part)
            x += centroids[labels[lo:hi]]
            if spec.features == "sparse":
                np.maximum(x, 0.0, out=x)
            feat_out.write(lo, x)
            del x
        feat_out.close()

        np.save(tmp / "labels.npy", labels)
        order = rng(_MASKS).permutation(n)
        n_train, n_val, n_test = (round(f * n) for f in (g.train_fraction, g.val_fraction, g.test_fraction))
        n_test = min(n_test, n - n_train - n_val)
        for name, (lo, hi) in zip(MASK_FILES, ((0, n_train), (n_train, n_train + n_val),
                                                (n_train + n_val, n_train + n_val + n_test))):
            mask = np.zeros(n, dtype=np.bool_)
            mask[order[lo:hi]] = True
            np.save(tmp / f"{name}.npy", mask)
        del order
        meta = {
            "format": DATASET_FORMAT, "version": DATASET_VERSION, "name": g.name, "num_nodes": n,
            "num_edges": 2 * m, "num_features": g.num_features, "num_classes": k, "directed": False,
            # Every undirected pair listed both ways, once each, no self-loops: readers may skip
            # symmetrization and deduplication.
            "symmetric": True,
            "generator": {"model": "streamed-chung-lu-sbm", "seed": int(seed), "features": spec.features,
                          "block_vertices": block, **_asdict(g)},
        }
        (tmp / DATASET_META).write_text(_json.dumps(meta, indent=1) + "\n")
        for child in tmp.iterdir():
            _os.chmod(child, 0o644)
        _atomic.replace_dir(tmp, out)
    except BaseException:
        _shutil.rmtree(tmp, ignore_errors=True)
        raise
    report(f"{g.name}: wrote {out}")
    return meta


MASK_FILES = ("train_mask", "val_mask", "test_mask")
