"""numba kernels behind :mod:`dorylus.models.kernels` (imported lazily from there; see its docstring).

The 16 scalar accumulators ``a0 .. a15`` are one block of 16 features kept in registers (two AVX2
vectors after LLVM's SLP vectoriser); written out by hand because numba has no fixed-size vector
type and a heap array would be summed through memory.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

# Entries per segment of a long row: the feature blocks of a segment re-read its rows of x, which
# must still be in the core's L2 cache (128 rows x 128 features x 4 B = 64 KB).
SEGMENT = 128
# Rows per task of live_rows.
LIVE_BLOCK = 16384
# Rows ahead whose output rows a sorted push prefetches (a part's rows have a few ghost entries each).
ROWS_AHEAD = 8


@intrinsic
def _prefetch(typingctx, arr, i, f):
    """Prefetch (read, keep in all cache levels) the cache line holding ``arr[i, f]``; never faults."""
    sig = types.void(arr, types.intp, types.intp)

    def codegen(context, builder, signature, args):
        aryty = signature.args[0]
        ary = context.make_array(aryty)(context, builder, args[0])
        ptr = cgutils.get_item_pointer2(context, builder, data=ary.data,
                                        shape=cgutils.unpack_tuple(builder, ary.shape),
                                        strides=cgutils.unpack_tuple(builder, ary.strides), layout=aryty.layout,
                                        inds=[args[1], args[2]], wraparound=False, boundscheck=False)
        i8p = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        fnty = ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0")
        builder.call(fn, [builder.bitcast(ptr, i8p), i32(0), i32(3), i32(1)])
        return context.get_dummy_value()

    return sig, codegen


@njit(cache=True, inline="always")
def _prefetch_row(x, j, width):
    # every line of the row: rows need not start on a line boundary, so also its last element
    for f in range(0, width, 16):
        _prefetch(x, j, f)
    _prefetch(x, j, width - 1)


@njit(cache=True, inline="always")
def _prefetch_ahead(x, col_scale, has_col_scale, j, width):
    # col_scale [C, 1] is read at random too: without its prefetch it is a second miss per entry
    _prefetch_row(x, j, width)
    if has_col_scale:
        _prefetch(col_scale, j, 0)


@njit(cache=True, inline="always")
def _row_span(indptr, indices, r, col_limit):
    # row r's entries; with col_limit >= 0, up to its first column >= col_limit (rows ascending)
    lo = indptr[r]
    hi = indptr[r + 1]
    if col_limit >= 0:
        hi = lo + np.searchsorted(indices[lo:hi], col_limit)
    return lo, hi


@njit(cache=True, inline="always")
def _entry_weight(values, has_values, col_scale, has_col_scale, k, j):
    # entry k's weight onto column j, rounded to float32 as both gather kernels must
    w = np.float32(1.0)
    if has_values:
        w = values[k]
    if has_col_scale:
        w = w * col_scale[j, 0]
    return w


@njit(parallel=True, cache=True, fastmath=False, nogil=True, boundscheck=False)
def gather_kernel(indptr, indices, x, values, has_values, col_scale, has_col_scale, row_scale, has_row_scale,
                  bounds, out, distance, col_limit):
    """``col_limit`` >= 0: each row's entries stop at its first column >= ``col_limit`` (rows
    ascending), found by bisection: no per-row array. Prefetches stay inside ``x``."""
    width = x.shape[1]
    blocked = width - width % 16
    limit = indptr[indptr.shape[0] - 1]
    x_rows = x.shape[0]
    zero = np.float32(0.0)
    for c in prange(bounds.shape[0] - 1):
        for r in range(bounds[c], bounds[c + 1]):
            lo, hi = _row_span(indptr, indices, r, col_limit)
            if hi == lo:
                for f in range(width):
                    out[r, f] = zero
                continue
            for s0 in range(lo, hi, SEGMENT):
                s1 = min(hi, s0 + SEGMENT)
                for f0 in range(0, blocked, 16):
                    if s0 == lo:
                        a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15 = zero, zero, zero, zero, zero, zero, zero, zero, zero, zero, zero, zero, zero, zero, zero, zero
                    else:
                        a0 = out[r, f0 + 0]
                        a1 = out[r, f0 + 1]
                        a2 = out[r, f0 + 2]
                        a3 = out[r, f0 + 3]
                        a4 = out[r, f0 + 4]
                        a5 = out[r, f0 + 5]
                        a6 = out[r, f0 + 6]
                        a7 = out[r, f0 + 7]
                        a8 = out[r, f0 + 8]
                        a9 = out[r, f0 + 9]
                        a10 = out[r, f0 + 10]
                        a11 = out[r, f0 + 11]
                        a12 = out[r, f0 + 12]
                        a13 = out[r, f0 + 13]
                        a14 = out[r, f0 + 14]
                        a15 = out[r, f0 + 15]
                    for k in range(s0, s1):
                        if f0 == 0 and k + distance < limit and indices[k + distance] < x_rows:
                            _prefetch_ahead(x, col_scale, has_col_scale, indices[k + distance], width)
                        j = indices[k]
                        w = _entry_weight(values, has_values, col_scale, has_col_scale, k, j)
                        a0 += w * x[j, f0 + 0]
                        a1 += w * x[j, f0 + 1]
                        a2 += w * x[j, f0 + 2]
                        a3 += w * x[j, f0 + 3]
                        a4 += w * x[j, f0 + 4]
                        a5 += w * x[j, f0 + 5]
                        a6 += w * x[j, f0 + 6]
                        a7 += w * x[j, f0 + 7]
                        a8 += w * x[j, f0 + 8]
                        a9 += w * x[j, f0 + 9]
                        a10 += w * x[j, f0 + 10]
                        a11 += w * x[j, f0 + 11]
                        a12 += w * x[j, f0 + 12]
                        a13 += w * x[j, f0 + 13]
                        a14 += w * x[j, f0 + 14]
                        a15 += w * x[j, f0 + 15]
                    out[r, f0 + 0] = a0
                    out[r, f0 + 1] = a1
                    out[r, f0 + 2] = a2
                    out[r, f0 + 3] = a3
                    out[r, f0 + 4] = a4
                    out[r, f0 + 5] = a5
                    out[r, f0 + 6] = a6
                    out[r, f0 + 7] = a7
                    out[r, f0 + 8] = a8
                    out[r, f0 + 9] = a9
                    out[r, f0 + 10] = a10
                    out[r, f0 + 11] = a11
                    out[r, f0 + 12] = a12
                    out[r, f0 + 13] = a13
                    out[r, f0 + 14] = a14
                    out[r, f0 + 15] = a15
                if blocked < width:
                    if s0 == lo:
                        for f in range(blocked, width):
                            out[r, f] = zero
                    for k in range(s0, s1):
                        if blocked == 0 and k + distance < limit and indices[k + distance] < x_rows:
                            _prefetch_ahead(x, col_scale, has_col_scale, indices[k + distance], width)
                        j = indices[k]
                        w = _entry_weight(values, has_values, col_scale, has_col_scale, k, j)
                        for f in range(blocked, width):
                            out[r, f] += w * x[j, f]
            if has_row_scale:
                s = row_scale[r]
                for f in range(width):
                    out[r, f] *= s


@njit(parallel=True, cache=True, fastmath=False, nogil=True, boundscheck=False)
def gather_live_kernel(indptr, indices, x, live, values, has_values, col_scale, has_col_scale, row_scale,
                       has_row_scale, bounds, out, distance, col_limit):
    """:func:`gather_kernel` over the entries whose row of ``x`` is live (``live[j] == 1``; the
    others are all zeros): each segment's live entries are listed first (without a branch), then
    summed, so a dead row is neither read nor prefetched. The same float32 operations in the same
    order as :func:`gather_kernel`, whose zero terms change no sum (the sums start at +0.0): the
    same bits. ``distance`` counts entries of the whole row, dead ones included."""
    width = x.shape[1]
    limit = indptr[indptr.shape[0] - 1]
    x_rows = x.shape[0]
    zero = np.float32(0.0)
    for c in prange(bounds.shape[0] - 1):
        kept = np.empty(SEGMENT, np.int64)
        acc = np.empty(width, np.float32)
        for r in range(bounds[c], bounds[c + 1]):
            lo, hi = _row_span(indptr, indices, r, col_limit)
            if hi == lo:
                for f in range(width):
                    out[r, f] = zero
                continue
            for f in range(width):
                acc[f] = zero
            for s0 in range(lo, hi, SEGMENT):
                s1 = min(hi, s0 + SEGMENT)
                m = 0
                for k in range(s0, s1):
                    if k + distance < limit:
                        ahead = indices[k + distance]
                        if ahead < x_rows and live[ahead]:
                            _prefetch_ahead(x, col_scale, has_col_scale, ahead, width)
                    kept[m] = k
                    m += live[indices[k]]
                for t in range(m):
                    k = kept[t]
                    j = indices[k]
                    w = _entry_weight(values, has_values, col_scale, has_col_scale, k, j)
                    for f in range(width):
                        acc[f] += w * x[j, f]
            if has_row_scale:
                s = row_scale[r]
                for f in range(width):
                    out[r, f] = acc[f] * s
            else:
                for f in range(width):
                    out[r, f] = acc[f]


@njit(parallel=True, cache=True, nogil=True, boundscheck=False)
def live_rows(x, live):
    """``live[r] = 1`` where row ``r`` of ``x`` has a non-zero (or NaN) element, else 0; returns
    the number of live rows."""
    rows, width = x.shape
    count = 0
    # blocks of rows, not rows, are what the threads take: kernels run with a chunk size of 1
    for b in prange((rows + LIVE_BLOCK - 1) // LIVE_BLOCK):
        block_count = 0
        for r in range(b * LIVE_BLOCK, min(rows, (b + 1) * LIVE_BLOCK)):
            flag = np.uint8(0)
            for f in range(width):
                if x[r, f] != 0:
                    flag = np.uint8(1)
                    break
            live[r] = flag
            block_count += flag
        count += block_count
    return count


@njit(parallel=True, cache=True, fastmath=False, nogil=True, boundscheck=False)
def probe_kernel(x, idx, bounds, partial, distance, group):
    """``partial[c] = sum of x[idx[k]]`` over chunk ``c``, read like a gather of rows of ``group`` entries."""
    width = x.shape[1]
    blocked = width - width % 16
    limit = idx.shape[0]
    zero = np.float32(0.0)
    for c in prange(bounds.shape[0] - 1):
        for g0 in range(bounds[c], bounds[c + 1], group):
            g1 = min(bounds[c + 1], g0 + group)
            for f0 in range(0, blocked, 16):
                a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15 = zero, zero, zero, zero, zero, zero, zero, zero, zero, zero, zero, zero, zero, zero, zero, zero
                for k in range(g0, g1):
                    if f0 == 0 and k + distance < limit:
                        _prefetch_row(x, idx[k + distance], width)
                    j = idx[k]
                    a0 += x[j, f0 + 0]
                    a1 += x[j, f0 + 1]
                    a2 += x[j, f0 + 2]
                    a3 += x[j, f0 + 3]
                    a4 += x[j, f0 + 4]
                    a5 += x[j, f0 + 5]
                    a6 += x[j, f0 + 6]
                    a7 += x[j, f0 + 7]
                    a8 += x[j, f0 + 8]
                    a9 += x[j, f0 + 9]
                    a10 += x[j, f0 + 10]
                    a11 += x[j, f0 + 11]
                    a12 += x[j, f0 + 12]
                    a13 += x[j, f0 + 13]
                    a14 += x[j, f0 + 14]
                    a15 += x[j, f0 + 15]
                partial[c, f0 + 0] += a0
                partial[c, f0 + 1] += a1
                partial[c, f0 + 2] += a2
                partial[c, f0 + 3] += a3
                partial[c, f0 + 4] += a4
                partial[c, f0 + 5] += a5
                partial[c, f0 + 6] += a6
                partial[c, f0 + 7] += a7
                partial[c, f0 + 8] += a8
                partial[c, f0 + 9] += a9
                partial[c, f0 + 10] += a10
                partial[c, f0 + 11] += a11
                partial[c, f0 + 12] += a12
                partial[c, f0 + 13] += a13
                partial[c, f0 + 14] += a14
                partial[c, f0 + 15] += a15
            for k in range(g0, g1):
                if blocked == 0 and k + distance < limit:
                    _prefetch_row(x, idx[k + distance], width)
                j = idx[k]
                for f in range(blocked, width):
                    partial[c, f] += x[j, f]


@njit(cache=True, nogil=True, boundscheck=False)
def transpose_fill(indptr, indices, indptr_t, indices_t, perm):
    """Counting sort of the entries by column: row ids ascend within a column (rows walked in order)."""
    cursor = indptr_t[:-1].copy()
    for r in range(indptr.shape[0] - 1):
        for k in range(indptr[r], indptr[r + 1]):
            c = indices[k]
            p = cursor[c]
            indices_t[p] = r
            perm[p] = k
            cursor[c] = p + 1


@njit(cache=True, nogil=True)
def cuthill_mckee(indptr, indices):
    """Cuthill-McKee order (not reversed): BFS per component from its minimum-degree vertex,
    unvisited neighbours appended by increasing degree (ties in their order in the row)."""
    n = indptr.shape[0] - 1
    degree = np.empty(n, np.int64)
    max_degree = 0
    for v in range(n):
        degree[v] = indptr[v + 1] - indptr[v]
        max_degree = max(max_degree, degree[v])
    seeds = np.argsort(degree, kind="mergesort")
    visited = np.zeros(n, np.bool_)
    order = np.empty(n, np.int64)
    buf = np.empty(max_degree, np.int64)
    bufdeg = np.empty(max_degree, np.int64)
    tail = 0
    for s in range(n):
        seed = seeds[s]
        if visited[seed]:
            continue
        visited[seed] = True
        head = tail
        order[tail] = seed
        tail += 1
        while head < tail:
            u = order[head]
            head += 1
            m = 0
            for k in range(indptr[u], indptr[u + 1]):
                v = indices[k]
                if not visited[v]:
                    visited[v] = True
                    buf[m] = v
                    bufdeg[m] = degree[v]
                    m += 1
            if m > 1:
                rank = np.argsort(bufdeg[:m], kind="mergesort")
                for i in range(m):
                    order[tail + i] = buf[rank[i]]
            elif m == 1:
                order[tail] = buf[0]
            tail += m
    return order


@njit(cache=True, nogil=True)
def label_propagation(indptr, indices, visit, rounds, settled):
    """Community labels by asynchronous label propagation: every vertex starts with its own id;
    each round visits the vertices in ``visit``'s order and gives each the label most frequent
    among its neighbours (ties: the smallest), at once visible to the ones after it. Stops after
    ``rounds`` rounds, or after a round that changed at most ``settled`` labels."""
    n = indptr.shape[0] - 1
    labels = np.arange(n)
    max_degree = 0
    for v in range(n):
        max_degree = max(max_degree, indptr[v + 1] - indptr[v])
    buf = np.empty(max_degree, np.int64)
    for _ in range(rounds):
        changed = 0
        for v in visit:
            m = 0
            for k in range(indptr[v], indptr[v + 1]):
                u = indices[k]
                if u != v:
                    buf[m] = labels[u]
                    m += 1
            if m == 0:
                continue
            run = np.sort(buf[:m])
            best, best_count, count = run[0], 1, 1
            for i in range(1, m):
                count = count + 1 if run[i] == run[i - 1] else 1
                if count > best_count:
                    best, best_count = run[i], count
            if best != labels[v]:
                labels[v] = best
                changed += 1
        if changed <= settled:
            break
    return labels


@njit(parallel=True, cache=True, fastmath=False, nogil=True, boundscheck=False)
def scatter_kernel(indptr, indices, g, values, has_values, row_scale, has_row_scale, col_scale, has_col_scale,
                   bounds, out, distance, sorted_rows):
    """``out = A^T g`` pushed from ``A``'s rows: thread ``t`` owns output rows ``[bounds[t], bounds[t + 1])``,
    walks every entry and adds those in its range (no per-thread copy of ``out``). Each ``out[c]``
    sums in increasing ``r`` whatever the split, as a gather over the transposed CSR would.

    ``sorted_rows`` (each row's columns ascend): a thread's entries in a row are one slice, found
    by bisection, and it prefetches the output rows of the row ``ROWS_AHEAD`` ahead: entries ahead
    in memory mostly lie outside the thread's range when the range is narrow (a part's ghosts)."""
    width = g.shape[1]
    blocked = width - width % 16
    rows = indptr.shape[0] - 1
    limit = indptr[rows]
    zero = np.float32(0.0)
    for t in prange(bounds.shape[0] - 1):
        c0 = bounds[t]
        c1 = bounds[t + 1]
        for c in range(c0, c1):
            for f in range(width):
                out[c, f] = zero
        for r in range(rows):
            lo = indptr[r]
            hi = indptr[r + 1]
            if sorted_rows:
                row = indices[lo:hi]
                hi = lo + np.searchsorted(row, c1)
                lo = lo + np.searchsorted(row, c0)
                ra = r + ROWS_AHEAD
                if ra < rows:
                    ahead_row = indices[indptr[ra]:indptr[ra + 1]]
                    for k in range(np.searchsorted(ahead_row, c0), np.searchsorted(ahead_row, c1)):
                        _prefetch_row(out, ahead_row[k], width)
            s = np.float32(1.0)
            if has_row_scale:
                s = row_scale[r]
            # g[r]'s 16-feature block in registers, added into each out row of the entries in range
            for f0 in range(0, blocked, 16):
                a0 = g[r, f0 + 0]
                a1 = g[r, f0 + 1]
                a2 = g[r, f0 + 2]
                a3 = g[r, f0 + 3]
                a4 = g[r, f0 + 4]
                a5 = g[r, f0 + 5]
                a6 = g[r, f0 + 6]
                a7 = g[r, f0 + 7]
                a8 = g[r, f0 + 8]
                a9 = g[r, f0 + 9]
                a10 = g[r, f0 + 10]
                a11 = g[r, f0 + 11]
                a12 = g[r, f0 + 12]
                a13 = g[r, f0 + 13]
                a14 = g[r, f0 + 14]
                a15 = g[r, f0 + 15]
                for k in range(lo, hi):
                    if f0 == 0 and not sorted_rows and k + distance < limit:
                        ahead = indices[k + distance]
                        if ahead >= c0 and ahead < c1:
                            _prefetch_row(out, ahead, width)
                    c = indices[k]
                    if c < c0 or c >= c1:
                        continue
                    # the weight rounds as the transposed gather's: values[k] * row_scale[r]
                    w = s
                    if has_values:
                        w = values[k] * s
                    out[c, f0 + 0] += w * a0
                    out[c, f0 + 1] += w * a1
                    out[c, f0 + 2] += w * a2
                    out[c, f0 + 3] += w * a3
                    out[c, f0 + 4] += w * a4
                    out[c, f0 + 5] += w * a5
                    out[c, f0 + 6] += w * a6
                    out[c, f0 + 7] += w * a7
                    out[c, f0 + 8] += w * a8
                    out[c, f0 + 9] += w * a9
                    out[c, f0 + 10] += w * a10
                    out[c, f0 + 11] += w * a11
                    out[c, f0 + 12] += w * a12
                    out[c, f0 + 13] += w * a13
                    out[c, f0 + 14] += w * a14
                    out[c, f0 + 15] += w * a15
                    # the features past the last block, while out[c] is in cache (one pass over the entries)
                    if f0 + 16 == blocked:
                        for f in range(blocked, width):
                            out[c, f] += w * g[r, f]
            if blocked == 0:
                for k in range(lo, hi):
                    if not sorted_rows and k + distance < limit:
                        ahead = indices[k + distance]
                        if ahead >= c0 and ahead < c1:
                            _prefetch_row(out, ahead, width)
                    c = indices[k]
                    if c < c0 or c >= c1:
                        continue
                    w = s
                    if has_values:
                        w = values[k] * s
                    for f in range(blocked, width):
                        out[c, f] += w * g[r, f]
        if has_col_scale:
            for c in range(c0, c1):
                sc = col_scale[c]
                for f in range(width):
                    out[c, f] *= sc
