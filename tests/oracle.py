"""Independent NumPy oracle of the semantics in docs/design.md ("Semantics"), plus test-input generators.

Written from that text and its "Semantic choices", never from jax_ep code:
- an id outside [-1, E) is treated as -1 and counted in `invalid_ids` (per rank);
- a top-k row may repeat an expert: counts are per distinct (token, expert), recv_topk_idx keeps every entry;
- normal dispatch below capacity keeps the first C rows in (source rank, source token) order, drops the rest;
- combine accumulates in float32 as `acc = 0; for r in 0..R-1: acc = acc + y_r[row]`, then `+ bias`, then casts;
  internode combine sums per node first (float32, rank order), then the nodes' partials (float32, node order);
- low-latency rows of a local expert are the distinct (source rank, source token) pairs in that order;
- expert-major rows are (source rank, source token, local expert) pairs, grouped by expert, each group in (source
  rank, source token) order; a rank's partial of a token adds its pairs in ascending local expert (float32, from 0)
  and is rounded to y's dtype before the ranks' partials are summed;
- FP8: per row and 128 channels, scale = max(amax, 1e-4) / 448 (optionally rounded up to a power of two),
  value = x / scale as float8_e4m3fn; UE8M0 packs the biased exponents of four scales per int32, little-endian.

Every function takes global inputs with a leading rank axis ([R, T, ...]) and returns per-rank expected outputs
with the same leading axis. Nothing here imports jax.
"""
from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
F32 = np.dtype(np.float32)

FP8_GROUP = 128  # channels per FP8 scale
FP8_MAX = np.float32(448.0)
FP8_AMAX_MIN = np.float32(1e-4)


# ----------------------------------------------------------------------------------------------------------------
# Routing basics
# ----------------------------------------------------------------------------------------------------------------
def sanitize_ids(topk_idx: np.ndarray, num_experts: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids with every entry outside [-1, E) replaced by -1 as int64 [R, T, K], invalid count per rank int32 [R])."""
    idx = np.asarray(topk_idx).astype(np.int64)
    bad = (idx < -1) | (idx >= num_experts)
    return np.where(bad, -1, idx), bad.sum(axis=(1, 2)).astype(np.int32)


def token_experts(ids_row: np.ndarray) -> list[int]:
    """Distinct valid experts of one token's (sanitized) top-k row, ascending."""
    return sorted({int(e) for e in ids_row if e >= 0})


def _local_experts(num_experts: int, num_ranks: int) -> int:
    assert num_experts % num_ranks == 0, (num_experts, num_ranks)
    return num_experts // num_ranks


# ----------------------------------------------------------------------------------------------------------------
# Layout
# ----------------------------------------------------------------------------------------------------------------
@dataclass
class Layout:
    num_tokens_per_rank: np.ndarray  # int32 [R, R]: [home rank s, destination r]
    num_tokens_per_expert: np.ndarray  # int32 [R, E]
    is_token_in_rank: np.ndarray  # bool [R, T, R]
    invalid_ids: np.ndarray  # int32 [R]


def layout(topk_idx: np.ndarray, num_experts: int) -> Layout:
    idx, invalid = sanitize_ids(topk_idx, num_experts)
    R, T, _ = idx.shape
    L = _local_experts(num_experts, R)
    in_rank = np.zeros((R, T, R), dtype=bool)
    per_expert = np.zeros((R, num_experts), dtype=np.int32)
    for s in range(R):
        for t in range(T):
            for e in token_experts(idx[s, t]):
                per_expert[s, e] += 1
                in_rank[s, t, e // L] = True
    per_rank = in_rank.sum(axis=1).astype(np.int32)
    return Layout(per_rank, per_expert, in_rank, invalid)


# ----------------------------------------------------------------------------------------------------------------
# Normal dispatch / combine
# ----------------------------------------------------------------------------------------------------------------
@dataclass
class Routing:
    """Which (home rank, token) each kept row of each receiving rank holds."""

    num_ranks: int
    num_tokens: int
    capacity: int
    rows: list[np.ndarray]  # rows[r]: int64 [n_r, 2] of (source rank, source token), in row order


@dataclass
class Dispatch:
    recv_x: list[np.ndarray]  # one array [R, C, ...] per payload component (one, or two for the FP8 pair)
    recv_topk_idx: np.ndarray  # int32 [R, C, K]
    recv_topk_weights: np.ndarray | None  # f32 [R, C, K]
    num_recv_tokens: np.ndarray  # int32 [R]
    num_recv_tokens_per_expert: np.ndarray  # int32 [R, L]
    num_dropped: np.ndarray  # int32 [R]
    invalid_ids: np.ndarray  # int32 [R]
    routing: Routing


def _as_components(x) -> list[np.ndarray]:
    return [np.asarray(c) for c in x] if isinstance(x, (tuple, list)) else [np.asarray(x)]


def routing(topk_idx: np.ndarray, num_experts: int, max_recv_tokens: int | None = None) -> tuple[Routing, np.ndarray]:
    """(kept rows per receiving rank, need per receiving rank int64 [R])."""
    lay = layout(topk_idx, num_experts)
    R, T, _ = lay.is_token_in_rank.shape
    C = R * T if max_recv_tokens is None else int(max_recv_tokens)
    rows, need = [], np.zeros(R, dtype=np.int64)
    for r in range(R):
        wanted = [(s, t) for s in range(R) for t in range(T) if lay.is_token_in_rank[s, t, r]]
        need[r] = len(wanted)
        rows.append(np.array(wanted[:C], dtype=np.int64).reshape(-1, 2))
    return Routing(R, T, C, rows), need


def dispatch(
    x,
    topk_idx: np.ndarray,
    topk_weights: np.ndarray | None,
    num_experts: int,
    max_recv_tokens: int | None = None,
    expert_alignment: int = 1,
) -> Dispatch:
    """x: [R, T, H] or a tuple of per-rank components (the FP8 pair), each passed through row-wise."""
    idx, invalid = sanitize_ids(topk_idx, num_experts)
    R, T, K = idx.shape
    L = _local_experts(num_experts, R)
    route, need = routing(topk_idx, num_experts, max_recv_tokens)
    C = route.capacity

    recv_x = cached_dispatch(x, route)
    recv_idx = np.full((R, C, K), -1, dtype=np.int32)
    recv_w = None if topk_weights is None else np.zeros((R, C, K), dtype=F32)
    per_expert = np.zeros((R, L), dtype=np.int64)
    for r in range(R):
        for i, (s, t) in enumerate(route.rows[r]):
            for k in range(K):
                e = idx[s, t, k]
                if e >= 0 and e // L == r:
                    recv_idx[r, i, k] = e - r * L
                    if recv_w is not None:
                        recv_w[r, i, k] = np.asarray(topk_weights)[s, t, k]
            for j in {int(v) for v in recv_idx[r, i] if v >= 0}:
                per_expert[r, j] += 1
    a = int(expert_alignment)
    per_expert = (per_expert + a - 1) // a * a
    n = np.array([len(rw) for rw in route.rows], dtype=np.int32)
    dropped = np.maximum(need - C, 0).astype(np.int32)
    return Dispatch(recv_x, recv_idx, recv_w, n, per_expert.astype(np.int32), dropped, invalid, route)


def cached_dispatch(x, route: Routing) -> list[np.ndarray]:
    """Rows of x (each payload component) placed as `route` says; padding rows zero."""
    out = []
    for comp in _as_components(x):
        R, T = comp.shape[:2]
        assert (R, T) == (route.num_ranks, route.num_tokens), (comp.shape, route.num_ranks, route.num_tokens)
        recv = np.zeros((R, route.capacity) + comp.shape[2:], dtype=comp.dtype)
        for r, rw in enumerate(route.rows):
            if len(rw):
                recv[r, : len(rw)] = comp[rw[:, 0], rw[:, 1]]
        out.append(recv)
    return out


def _sum_back_f32(v: np.ndarray, route: Routing) -> np.ndarray:
    """f32 [R, T, ...]: for every home token, acc = 0; for r = 0..R-1 (rank order): acc = acc + v_r[row]."""
    R, T = route.num_ranks, route.num_tokens
    acc = np.zeros((R, T) + v.shape[2:], dtype=F32)
    for r, rw in enumerate(route.rows):  # each (s, t) appears at most once per r: one vectorized add per rank
        if len(rw):
            acc[rw[:, 0], rw[:, 1]] = acc[rw[:, 0], rw[:, 1]] + v[r, : len(rw)].astype(F32)
    return acc


def combine(
    y: np.ndarray,
    route: Routing,
    topk_weights: np.ndarray | None = None,
    bias: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray | None]:
    """(out [R, T, H] dtype of y, combined weights f32 [R, T, K] or None). Padding / unused rows are ignored."""
    y = np.asarray(y)
    acc = _sum_back_f32(y, route)
    if bias is not None:
        acc = acc + np.asarray(bias).astype(F32)
    w = None if topk_weights is None else _sum_back_f32(np.asarray(topk_weights), route)
    return acc.astype(y.dtype), w


def combine_internode(
    y: np.ndarray,
    route: Routing,
    ranks_per_node: int,
    topk_weights: np.ndarray | None = None,
    bias: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray | None]:
    """combine() with the internode order (docs/design.md, "Internode normal mode": reduce inside the node, then across
    nodes). Ranks r = node * ranks_per_node + j. For every home token: per node m, partial_m = 0;
    partial_m = partial_m + y_r[row] for the node's ranks r that kept it, in r order (float32); then acc = 0;
    acc = acc + partial_m for m = 0, 1, ... (float32); then + bias; then cast. A node that kept nothing adds
    +0.0, which changes no sum that starts from +0.0."""
    y = np.asarray(y)
    acc = _sum_back_by_node_f32(y, route, ranks_per_node)
    if bias is not None:
        acc = acc + np.asarray(bias).astype(F32)
    w = None if topk_weights is None else _sum_back_by_node_f32(np.asarray(topk_weights), route, ranks_per_node)
    return acc.astype(y.dtype), w


def _sum_back_by_node_f32(v: np.ndarray, route: Routing, ranks_per_node: int) -> np.ndarray:
    R, T = route.num_ranks, route.num_tokens
    assert R % ranks_per_node == 0, (R, ranks_per_node)
    partial = np.zeros((R // ranks_per_node, R, T) + v.shape[2:], dtype=F32)
    for r, rw in enumerate(route.rows):  # r ascending: within a node, local rank order
        if len(rw):
            part = partial[r // ranks_per_node]
            part[rw[:, 0], rw[:, 1]] = part[rw[:, 0], rw[:, 1]] + v[r, : len(rw)].astype(F32)
    acc = np.zeros((R, T) + v.shape[2:], dtype=F32)
    for part in partial:  # node order
        acc = acc + part
    return acc


# --- normal-mode VJPs ---------------------------------------------------------------------------------------------
def dispatch_vjp(
    route: Routing,
    recv_topk_idx: np.ndarray,
    g_recv_x: np.ndarray,
    g_recv_topk_weights: np.ndarray | None,
    x_dtype,
) -> tuple[np.ndarray, np.ndarray | None]:
    """(dx [R, T, H] in x's dtype, d topk_weights f32 [R, T, K]).

    recv_x rows are copies of x rows: dx[t] = Σ over ranks that kept t of the cotangent row. recv_topk_weights[k]
    is the weight where the expert is on that rank, else the constant 0: only those entries carry a cotangent."""
    dx = _sum_back_f32(np.asarray(g_recv_x), route).astype(x_dtype)
    dw = None
    if g_recv_topk_weights is not None:
        masked = np.where(np.asarray(recv_topk_idx) >= 0, np.asarray(g_recv_topk_weights, dtype=F32), np.float32(0))
        dw = _sum_back_f32(masked, route)
    return dx, dw


def combine_vjp(
    route: Routing,
    g_out: np.ndarray,
    g_topk_weights: np.ndarray | None,
    y_dtype,
    bias_dtype=None,
) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    """(dy [R, C, H] in y's dtype, d topk_weights f32 [R, C, K], d bias [R, T, H] in bias's dtype).

    Every kept row of y enters its home token's sum once: dy is the cached dispatch of the output cotangent
    (padding rows 0); likewise the weights (all K entries are summed); the bias is added once."""
    (dy,) = cached_dispatch(np.asarray(g_out), route)
    dw = None if g_topk_weights is None else cached_dispatch(np.asarray(g_topk_weights, dtype=F32), route)[0]
    db = None if bias_dtype is None else np.asarray(g_out).astype(bias_dtype)
    return dy.astype(y_dtype), dw, db


# ----------------------------------------------------------------------------------------------------------------
# Expert-major layout of the normal dispatch (docs/design.md, "Expert-major layout")
# ----------------------------------------------------------------------------------------------------------------
@dataclass
class ExpertMajorRouting:
    """Which (source rank, source token, local expert) pair each kept row of each receiving rank holds."""

    num_ranks: int
    num_tokens: int
    capacity: int
    pairs: list[np.ndarray]  # pairs[r]: int64 [n_r, 3] (source rank, source token, local expert) of each kept pair
    rows: list[np.ndarray]  # rows[r]: int64 [n_r], its row


@dataclass
class ExpertMajorDispatch:
    recv_x: list[np.ndarray]  # one array [R, C, ...] per payload component (one, or two for the FP8 pair)
    recv_weights: np.ndarray | None  # f32 [R, C]: pair weight on kept rows, 0 elsewhere
    num_recv_tokens: np.ndarray  # int32 [R]: kept pairs
    num_recv_tokens_per_expert: np.ndarray  # int32 [R, L]: group sizes (aligned, not clipped to C)
    expert_offsets: np.ndarray  # int32 [R, L]: first row of each group (not clipped to C)
    num_dropped: np.ndarray  # int32 [R]: pairs not kept
    invalid_ids: np.ndarray  # int32 [R]
    routing: ExpertMajorRouting


def expert_major_capacity(num_ranks: int, num_tokens: int, num_topk: int, num_local_experts: int,
                          expert_alignment: int = 1) -> int:
    """The default C: every received token with min(K, L) pairs, every group padded by alignment - 1."""
    return num_ranks * num_tokens * min(num_topk, num_local_experts) + num_local_experts * (expert_alignment - 1)


def expert_major_dispatch(
    x,
    topk_idx: np.ndarray,
    topk_weights: np.ndarray | None,
    num_experts: int,
    max_recv_tokens: int | None = None,
    expert_alignment: int = 1,
) -> ExpertMajorDispatch:
    """x: [R, T, H] or a tuple of per-rank components (the FP8 pair), each passed through row-wise.

    Per receiving rank r and local expert j, the pairs of expert j are the tokens (s, t) in (s, t) order that
    have a valid entry naming global expert r*L + j (once however many entries name it); count[j] of them,
    size[j] = count rounded up to the alignment, offset[j] = size[0] + ... + size[j-1]; the i-th pair of expert j
    has row offset[j] + i and is kept when that row is below C. The pair weight is 0 + w[k] + ... over the
    entries k naming the expert, in top-k order, in float32."""
    idx, invalid = sanitize_ids(topk_idx, num_experts)
    R, T, K = idx.shape
    L = _local_experts(num_experts, R)
    a = int(expert_alignment)
    assert a >= 1, a
    C = expert_major_capacity(R, T, K, L, a) if max_recv_tokens is None else int(max_recv_tokens)
    w = None if topk_weights is None else np.asarray(topk_weights, dtype=F32)

    sizes = np.zeros((R, L), dtype=np.int64)
    offsets = np.zeros((R, L), dtype=np.int64)
    kept = np.zeros(R, dtype=np.int64)
    dropped = np.zeros(R, dtype=np.int64)
    recv_w = None if w is None else np.zeros((R, C), dtype=F32)
    pairs, rows = [], []
    for r in range(R):
        groups: list[list[tuple[int, int]]] = [[] for _ in range(L)]
        for s in range(R):
            for t in range(T):
                for e in token_experts(idx[s, t]):
                    if e // L == r:
                        groups[e % L].append((s, t))
        start = 0
        rank_pairs, rank_rows = [], []
        for j in range(L):
            count = len(groups[j])
            sizes[r, j] = (count + a - 1) // a * a
            offsets[r, j] = start
            for i, (s, t) in enumerate(groups[j]):
                row = start + i
                if row >= C:
                    dropped[r] += 1
                    continue
                rank_pairs.append((s, t, j))
                rank_rows.append(row)
                if recv_w is not None:
                    pw = np.float32(0.0)
                    for k in range(K):  # top-k order
                        if idx[s, t, k] == r * L + j:
                            pw = np.float32(pw + w[s, t, k])
                    recv_w[r, row] = pw
            start += int(sizes[r, j])
        kept[r] = len(rank_rows)
        pairs.append(np.array(rank_pairs, dtype=np.int64).reshape(-1, 3))
        rows.append(np.array(rank_rows, dtype=np.int64).reshape(-1))
    route = ExpertMajorRouting(R, T, C, pairs, rows)
    return ExpertMajorDispatch(expert_major_cached_dispatch(x, route), recv_w, kept.astype(np.int32),
                               sizes.astype(np.int32), offsets.astype(np.int32), dropped.astype(np.int32), invalid,
                               route)


def expert_major_cached_dispatch(x, route: ExpertMajorRouting) -> list[np.ndarray]:
    """Each kept pair's row holds its source token's row (every payload component); other rows zero."""
    out = []
    for comp in _as_components(x):
        R, T = comp.shape[:2]
        assert (R, T) == (route.num_ranks, route.num_tokens), (comp.shape, route.num_ranks, route.num_tokens)
        recv = np.zeros((R, route.capacity) + comp.shape[2:], dtype=comp.dtype)
        for r in range(R):
            pr, rw = route.pairs[r], route.rows[r]
            if len(rw):
                recv[r, rw] = comp[pr[:, 0], pr[:, 1]]
        out.append(recv)
    return out


def _expert_major_partials(y: np.ndarray, route: ExpertMajorRouting, weights: np.ndarray | None):
    """(partials f32 [R (receiving rank), R, T, ...], present bool [R, R, T]): per rank p = 0; for the token's
    kept pairs on that rank in ascending local expert: p = p + f32(w * y[row]) (w = 1 when None); then p rounded to
    y's dtype (the partial travels in it) and read back as float32."""
    y = np.asarray(y)
    R, T = route.num_ranks, route.num_tokens
    part = np.zeros((R, R, T) + y.shape[2:], dtype=F32)
    present = np.zeros((R, R, T), dtype=bool)
    w = None if weights is None else np.asarray(weights, dtype=F32)
    for r in range(R):
        pr, rw = route.pairs[r], route.rows[r]
        if not len(rw):
            continue
        for j in sorted({int(v) for v in pr[:, 2]}):  # ascending local expert; a token has one pair per expert
            sel = pr[:, 2] == j
            s, t, rows = pr[sel, 0], pr[sel, 1], rw[sel]
            term = y[r, rows].astype(F32)
            if w is not None:
                term = (w[r, rows].reshape((-1,) + (1,) * (term.ndim - 1)) * term).astype(F32)
            part[r, s, t] = part[r, s, t] + term
            present[r, s, t] = True
    return part.astype(y.dtype).astype(F32), present


def _expert_major_sum_f32(y, route: ExpertMajorRouting, weights=None, ranks_per_node=None) -> np.ndarray:
    """f32 [R, T, ...]: the ranks' partials summed in rank order from 0 (or per node, then the nodes in order).
    A rank whose pairs of a token were all dropped holds a +0.0 partial, which changes no such sum: it is left
    out here."""
    part, present = _expert_major_partials(y, route, weights)
    R = route.num_ranks
    P = R if ranks_per_node is None else int(ranks_per_node)
    assert R % P == 0, (R, P)
    expand = lambda m: m.reshape(m.shape + (1,) * (part.ndim - 3))  # noqa: E731
    acc = np.zeros(part.shape[1:], dtype=F32)
    for node in range(R // P):
        node_sum = np.zeros(part.shape[1:], dtype=F32)
        node_has = np.zeros(present.shape[1:], dtype=bool)
        for r in range(node * P, (node + 1) * P):  # local rank order
            node_sum = np.where(expand(present[r]), node_sum + part[r], node_sum).astype(F32)
            node_has |= present[r]
        acc = np.where(expand(node_has), acc + node_sum, acc).astype(F32)  # node order
    return acc


def expert_major_combine(
    y: np.ndarray,
    route: ExpertMajorRouting,
    weights: np.ndarray | None = None,
    bias: np.ndarray | None = None,
    ranks_per_node: int | None = None,
) -> np.ndarray:
    """[R, T, H] in y's dtype: per-rank float32 partials of the token's kept pairs in ascending local expert
    (each term f32(w * y), w = 1 when None), each rounded to y's dtype, summed over ranks in float32 in rank order
    from 0 (with ranks_per_node:
    per node in local rank order, then the nodes in order, as combine_internode), + bias in float32, then cast."""
    y = np.asarray(y)
    acc = _expert_major_sum_f32(y, route, weights, ranks_per_node)
    if bias is not None:
        acc = acc + np.asarray(bias).astype(F32)
    return acc.astype(y.dtype)


def _expert_major_row_of_entry(route: ExpertMajorRouting, topk_idx: np.ndarray, num_experts: int) -> np.ndarray:
    """int64 [R, T, K]: the row (on the rank of the entry's expert) of the kept pair entry k maps to, else -1."""
    idx, _ = sanitize_ids(topk_idx, num_experts)
    R, T, K = idx.shape
    L = _local_experts(num_experts, R)
    where = {}
    for r in range(R):
        for (s, t, j), row in zip(route.pairs[r].tolist(), route.rows[r].tolist()):
            where[(r, s, t, j)] = row
    out = np.full((R, T, K), -1, dtype=np.int64)
    for s in range(R):
        for t in range(T):
            for k in range(K):
                e = int(idx[s, t, k])
                if e >= 0:
                    out[s, t, k] = where.get((e // L, s, t, e % L), -1)
    return out


def expert_major_dispatch_vjp(
    route: ExpertMajorRouting,
    topk_idx: np.ndarray,
    num_experts: int,
    g_recv_x: np.ndarray,
    g_recv_weights: np.ndarray | None,
    x_dtype,
) -> tuple[np.ndarray, np.ndarray | None]:
    """(dx [R, T, H] in x's dtype, d topk_weights f32 [R, T, K] or None).

    Each kept row is a copy of its token: dx is the unweighted expert-major combine of the cotangent rows. The pair
    weight is a sum of its entries' weights: entry k gets the cotangent of its kept pair's weight, 0 for -1,
    invalid ids and dropped pairs."""
    dx = _expert_major_sum_f32(np.asarray(g_recv_x), route).astype(x_dtype)
    dw = None
    if g_recv_weights is not None:
        g = np.asarray(g_recv_weights, dtype=F32)
        idx, _ = sanitize_ids(topk_idx, num_experts)
        L = _local_experts(num_experts, route.num_ranks)
        row = _expert_major_row_of_entry(route, topk_idx, num_experts)
        dw = np.zeros(row.shape, dtype=F32)
        for s, t, k in zip(*np.nonzero(row >= 0)):
            dw[s, t, k] = g[idx[s, t, k] // L, row[s, t, k]]
    return dx, dw


def expert_major_combine_vjp(
    route: ExpertMajorRouting,
    g_out: np.ndarray,
    y: np.ndarray,
    weights: np.ndarray | None,
    y_dtype,
    bias_dtype=None,
) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    """(dy [R, C, H] in y's dtype, d weights f32 [R, C] or None, d bias [R, T, H] in bias's dtype or None).

    Each kept row enters its home token's sum once as w * y[row]: dy[row] = f32(w[row] * g_out[token]) (g_out
    itself without weights), then cast; d weights[row] = the dot of g_out[token] and y[row], here summed in float64
    and rounded once to float32 (a float32 dot in another order differs by at most ~H ulps of the sum of |terms|);
    padding rows get 0."""
    g = np.asarray(g_out)
    y = np.asarray(y)
    R, C = route.num_ranks, route.capacity
    dy = np.zeros((R, C) + g.shape[2:], dtype=F32)
    dw = None if weights is None else np.zeros((R, C), dtype=F32)
    w = None if weights is None else np.asarray(weights, dtype=F32)
    for r in range(R):
        pr, rw = route.pairs[r], route.rows[r]
        if not len(rw):
            continue
        gr = g[pr[:, 0], pr[:, 1]].astype(F32)
        if w is None:
            dy[r, rw] = gr
        else:
            dy[r, rw] = (w[r, rw].reshape((-1,) + (1,) * (gr.ndim - 1)) * gr).astype(F32)
            prod = gr.astype(np.float64) * y[r, rw].astype(F32).astype(np.float64)
            dw[r, rw] = prod.reshape(len(rw), -1).sum(axis=1).astype(F32)
    db = None if bias_dtype is None else g.astype(bias_dtype)
    return dy.astype(y_dtype), dw, db


# ----------------------------------------------------------------------------------------------------------------
# FP8 per-128-channel cast
# ----------------------------------------------------------------------------------------------------------------
def _pow2_ceil(v: np.ndarray) -> np.ndarray:
    """2**ceil(log2(v)) for positive finite float32 v, exactly (from the bits, no log rounding)."""
    v = np.asarray(v, dtype=F32)
    mant, exp = np.frexp(v)  # v = mant * 2**exp, mant in [0.5, 1)
    exp = np.where(mant == 0.5, exp - 1, exp)
    return np.ldexp(np.ones_like(v), exp).astype(F32)


def fp8_scales(x: np.ndarray, round_scale: bool = False) -> np.ndarray:
    """f32 [..., H/128] scale per 128 channels of the rows of x [..., H]."""
    xf = np.asarray(x).astype(F32)
    H = xf.shape[-1]
    assert H % FP8_GROUP == 0, H
    groups = xf.reshape(xf.shape[:-1] + (H // FP8_GROUP, FP8_GROUP))
    amax = np.maximum(np.abs(groups).max(axis=-1, initial=np.float32(0)), FP8_AMAX_MIN).astype(F32)
    # Team rule (as DeepEP): scale = amax * float32(1/448), a multiplication by the rounded reciprocal.
    scale = (amax * np.float32(1.0 / FP8_MAX)).astype(F32)
    return _pow2_ceil(scale) if round_scale else scale


def fp8_cast(x: np.ndarray, round_scale: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(e4m3 [..., H], scales f32 [..., H/128]) with value = x / scale."""
    xf = np.asarray(x).astype(F32)
    scale = fp8_scales(x, round_scale)
    q = (xf / np.repeat(scale, FP8_GROUP, axis=-1)).astype(F32).astype(E4M3)
    return q, scale


def ue8m0_pack(scale: np.ndarray) -> np.ndarray:
    """int32 [..., G/4]: byte i (little-endian) of word w = biased exponent of the scale of group 4w+i."""
    scale = np.asarray(scale, dtype=F32)
    G = scale.shape[-1]
    assert G % 4 == 0, G
    exps = ((scale.view(np.uint32) >> 23) & 0xFF).astype(np.uint32)
    exps = exps.reshape(scale.shape[:-1] + (G // 4, 4))
    words = exps[..., 0] | (exps[..., 1] << 8) | (exps[..., 2] << 16) | (exps[..., 3] << 24)
    return words.astype(np.uint32).view(np.int32)


def ue8m0_unpack(words: np.ndarray) -> np.ndarray:
    """f32 [..., 4W] scales 2**(byte - 127) from packed int32 [..., W]."""
    w = np.asarray(words).astype(np.int32).view(np.uint32)
    exps = np.stack([(w >> (8 * i)) & 0xFF for i in range(4)], axis=-1).reshape(w.shape[:-1] + (4 * w.shape[-1],))
    return (exps.astype(np.uint32) << 23).view(F32)


def fp8_dequant(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    return (np.asarray(q).astype(F32) * np.repeat(np.asarray(scale, dtype=F32), FP8_GROUP, axis=-1)).astype(F32)


def deepep_diff(x: np.ndarray, y: np.ndarray) -> float:
    """DeepEP's calc_diff: 1 - 2 Σab / Σ(a² + b²) with a = x + 1, b = y + 1 (float64)."""
    a = np.asarray(x, dtype=np.float64) + 1.0
    b = np.asarray(y, dtype=np.float64) + 1.0
    den = float((a * a + b * b).sum())
    return 0.0 if den == 0.0 else 1.0 - 2.0 * float((a * b).sum()) / den


# ----------------------------------------------------------------------------------------------------------------
# Low-latency dispatch / combine
# ----------------------------------------------------------------------------------------------------------------
@dataclass
class LowLatencyDispatch:
    rows: list[list[np.ndarray]]  # rows[r][j]: int64 [recv_count, 2] of (source rank, source token), in row order
    recv_count: np.ndarray  # int32 [R, L]
    valid: np.ndarray  # bool [R, L, R*M]: rows < recv_count (only these are specified)
    recv_x: np.ndarray  # bf16 [R, L, R*M, H] (valid rows only are meaningful; the rest are 0 here)
    recv_x_fp8: np.ndarray | None  # e4m3 [R, L, R*M, H]
    recv_scales: np.ndarray | None  # f32 [R, L, R*M, H/128]
    recv_scales_ue8m0: np.ndarray | None  # int32 [R, L, R*M, H/512]
    src_token_index: np.ndarray  # int32 [R, L, R*M], -1 beyond recv_count
    layout_range: np.ndarray  # int32 [R, L, R, 2]: (first row, count) per source rank
    cumulative_stats: np.ndarray | None  # int32 [R, L]
    invalid_ids: np.ndarray  # int32 [R]
    num_masked: np.ndarray  # int32 [R]: top-k entries not sent because their expert's rank is masked by the sender
    masked: np.ndarray  # bool [R, R]: the masks the dispatch ran with


def low_latency_dispatch(
    x: np.ndarray,
    topk_idx: np.ndarray,
    num_experts: int,
    num_max_dispatch_tokens_per_rank: int,
    use_fp8: bool = False,
    round_scale: bool = False,
    use_ue8m0: bool = False,
    cumulative_stats: np.ndarray | None = None,
    masked: np.ndarray | None = None,
) -> LowLatencyDispatch:
    """masked: bool [R, R], masked[s, p] when rank s masks rank p (never itself). A row (s, t) reaches expert e on
    rank r only where neither of s and r masks the other: s does not send it (counting the entry in num_masked[s])
    and r does not receive from s."""
    x = np.asarray(x)
    idx, invalid = sanitize_ids(topk_idx, num_experts)
    R, T, _ = idx.shape
    masked = np.zeros((R, R), bool) if masked is None else np.asarray(masked, bool)
    assert masked.shape == (R, R) and not masked.diagonal().any()
    H = x.shape[-1]
    M = int(num_max_dispatch_tokens_per_rank)
    assert T <= M, (T, M)
    L = _local_experts(num_experts, R)
    num_masked = np.array([sum(int(masked[s, e // L]) for e in idx[s].reshape(-1) if e >= 0) for s in range(R)],
                          np.int32)

    lists: list[list[list[tuple[int, int]]]] = [[[] for _ in range(L)] for _ in range(R)]
    for s in range(R):  # (s, t) ascending: rows come out ordered by source rank, then source token
        for t in range(T):
            for e in token_experts(idx[s, t]):
                if not (masked[s, e // L] or masked[e // L, s]):
                    lists[e // L][e % L].append((s, t))
    rows = [[np.array(lists[r][j], dtype=np.int64).reshape(-1, 2) for j in range(L)] for r in range(R)]

    count = np.array([[len(rows[r][j]) for j in range(L)] for r in range(R)], dtype=np.int32).reshape(R, L)
    valid = np.arange(R * M)[None, None, :] < count[:, :, None]
    recv_x = np.zeros((R, L, R * M, H), dtype=x.dtype)
    src = np.full((R, L, R * M), -1, dtype=np.int32)
    rng_ = np.zeros((R, L, R, 2), dtype=np.int32)
    for r in range(R):
        for j in range(L):
            rw = rows[r][j]
            if len(rw):
                recv_x[r, j, : len(rw)] = x[rw[:, 0], rw[:, 1]]
                src[r, j, : len(rw)] = rw[:, 1]
            start = 0
            for s in range(R):
                c = int((rw[:, 0] == s).sum())
                rng_[r, j, s] = (start, c)
                start += c

    q = sc = packed = None
    if use_fp8:
        if use_ue8m0:
            assert round_scale, "use_ue8m0 requires round_scale"
        q, sc = fp8_cast(recv_x, round_scale)
        if use_ue8m0:
            packed = ue8m0_pack(sc)
    stats = None
    if cumulative_stats is not None:
        stats = (np.asarray(cumulative_stats).astype(np.int64) + count).astype(np.int32)
    return LowLatencyDispatch(rows, count, valid, recv_x, q, sc, packed, src, rng_, stats, invalid, num_masked,
                              masked)


def low_latency_combine(
    y: np.ndarray,
    topk_idx: np.ndarray,
    topk_weights: np.ndarray,
    num_experts: int,
    ll: LowLatencyDispatch,
    masked: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """(out f32 [R, T, H] before the final bf16 cast, Σ_k |w·y| f32 [R, T, H] for error bounds).

    out[t] = Σ over k in order of w[t,k] · y[expert k's local j on its rank][row of (t, e_k)], acc = 0 in f32,
    invalid / -1 entries skipped; a repeated expert contributes once per k entry. masked (as for
    low_latency_dispatch; None: the dispatch's): an entry adds nothing where its expert's rank and the token's
    rank mask one another, now or when `ll` was dispatched (then no row was delivered)."""
    y = np.asarray(y)
    w = np.asarray(topk_weights, dtype=F32)
    idx, _ = sanitize_ids(topk_idx, num_experts)
    R, T, K = idx.shape
    H = y.shape[-1]
    L = _local_experts(num_experts, R)
    masked = (ll.masked if masked is None else np.asarray(masked, bool)) | ll.masked
    where = {}
    for r in range(R):
        for j in range(L):
            for i, (s, t) in enumerate(ll.rows[r][j]):
                where[(r * L + j, int(s), int(t))] = (r, j, i)
    acc = np.zeros((R, T, H), dtype=F32)
    mag = np.zeros((R, T, H), dtype=F32)
    for s in range(R):
        for t in range(T):
            for k in range(K):
                e = int(idx[s, t, k])
                if e < 0:
                    continue
                if masked[s, e // L] or masked[e // L, s]:
                    continue
                r, j, i = where[(e, s, t)]
                term = (w[s, t, k] * y[r, j, i].astype(F32)).astype(F32)
                acc[s, t] = acc[s, t] + term
                mag[s, t] += np.abs(term)
    return acc, mag


# ----------------------------------------------------------------------------------------------------------------
# LogFMT-10 (the compressed low-latency combine's payload), from its definition in jax_ep/logfmt.py's docstring:
# blocks of 128 values; amax, amin (the smallest non-zero magnitude, at least amax * 2^-32, as bfloat16); codes
# q = 1 + round(log2(|x| / amin) / step), step = log2(amax / amin) / 510; |x| below amin * 2^(-step/2) or below
# 2^-126 is 0; decoded amin * 2^((q - 1) * step). Computed here in float64; the coders' float32 adds at most
# LOGFMT_FLOAT32_SLACK relative.
# ----------------------------------------------------------------------------------------------------------------
LOGFMT_BLOCK = 128
LOGFMT_MAX_CODE = 511
LOGFMT_MAX_OCTAVES = 32
LOGFMT_SMALLEST_NORMAL = 2.0 ** -126
LOGFMT_FLOAT32_SLACK = 4e-6


def logfmt_roundtrip(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x bfloat16 [..., H] -> (decoded float64 [..., H], step per value [..., H], amin per value [..., H])."""
    v = np.asarray(x).astype(np.float64)
    blocks = v.reshape(*v.shape[:-1], -1, LOGFMT_BLOCK)
    mag = np.abs(blocks)
    mag = np.where(mag < LOGFMT_SMALLEST_NORMAL, 0.0, mag)  # subnormals count as zero
    amax = mag.max(axis=-1, keepdims=True)
    smallest = np.where(mag > 0, mag, np.inf).min(axis=-1, keepdims=True)
    floor = np.maximum((amax * 2.0 ** -LOGFMT_MAX_OCTAVES).astype(ml_dtypes.bfloat16).astype(np.float64),
                       LOGFMT_SMALLEST_NORMAL)
    amin = np.where(amax > 0, np.maximum(smallest, floor), 0.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        step = np.where(amax > 0, np.log2(amax / amin) / (LOGFMT_MAX_CODE - 1), 0.0)
        q = np.where(step > 0, np.round(np.log2(np.maximum(mag, amin) / amin) / np.where(step > 0, step, 1)), 0)
        q = np.clip(q, 0, LOGFMT_MAX_CODE - 1) + 1
        q = np.where((mag == 0) | (mag < amin * np.exp2(-step / 2)), 0, q)
        out = np.where(q > 0, amin * np.exp2((q - 1) * step), 0.0) * np.sign(blocks)
    out = np.where(np.all(np.isfinite(blocks), axis=-1, keepdims=True), out, np.nan)
    spread = lambda a: np.broadcast_to(a, blocks.shape).reshape(v.shape)  # noqa: E731
    return out.reshape(v.shape), spread(step), spread(amin)


def logfmt_error_bound(x: np.ndarray, step: np.ndarray, amin: np.ndarray) -> np.ndarray:
    """A bound on |decoded - x| per value: (2^(step/2) - 1 + LOGFMT_FLOAT32_SLACK)|x| for a value the format keeps;
    for one at or below the flush threshold max(amin * 2^(-step/2), 2^-126) (within float32 rounding of it, where
    a coder may decide either way), the threshold too."""
    mag = np.abs(np.asarray(x).astype(np.float64))
    kept = (np.exp2(step / 2) - 1 + LOGFMT_FLOAT32_SLACK) * mag
    threshold = np.maximum(amin * np.exp2(-step / 2), LOGFMT_SMALLEST_NORMAL)
    return np.where(mag <= threshold * (1 + 1e-5), np.maximum(kept, threshold), kept)


def low_latency_combine_logfmt(y, topk_idx, topk_weights, num_experts: int, ll) -> tuple[np.ndarray, np.ndarray]:
    """(the float32 k-order sum of the uncompressed rows, a bound on |compressed combine - it|): each row within
    logfmt_error_bound of its own, so sum_k |w_k| * bound(row k), plus the output's bfloat16 rounding."""
    acc, mag = low_latency_combine(y, topk_idx, topk_weights, num_experts, ll)
    _, step, amin = logfmt_roundtrip(y)
    row_error, _ = low_latency_combine(logfmt_error_bound(y, step, amin), topk_idx, np.abs(topk_weights), num_experts,
                                       ll)
    return acc, row_error + 2.0 ** -8 * (np.abs(acc) + row_error) * 1.01 + 1e-5 * mag + 1e-38


# ----------------------------------------------------------------------------------------------------------------
# Test-input generators (NumPy only)
# ----------------------------------------------------------------------------------------------------------------
ROUTING_MODES = ("uniform", "distinct", "skewed", "one_rank", "empty", "dense_dups")
_INVALID_VALUES = (-2, -7, -(2**31), 2**31 - 1)


def make_topk_idx(
    rng: np.random.Generator,
    R: int,
    T: int,
    K: int,
    E: int,
    mode: str = "uniform",
    p_neg: float = 0.1,
    p_invalid: float = 0.0,
) -> np.ndarray:
    """int32 [R, T, K] expert ids for the routing `mode`, with -1 entries (prob. p_neg) and out-of-range ids
    (prob. p_invalid: >= E or < -1) sprinkled in."""
    L = E // R
    if mode == "uniform":  # repeats possible
        idx = rng.integers(0, E, size=(R, T, K))
    elif mode == "distinct":  # DeepEP-style top-k: distinct experts per token where K <= E
        idx = np.argsort(rng.random((R, T, max(E, K))), axis=-1)[..., :K] % E
    elif mode == "skewed":  # every token to one expert (in every k slot)
        idx = np.full((R, T, K), int(rng.integers(0, E)))
    elif mode == "one_rank":  # only the experts of one rank: every other rank receives nothing
        r0 = int(rng.integers(0, R))
        idx = rng.integers(r0 * L, (r0 + 1) * L, size=(R, T, K))
    elif mode == "empty":
        idx = np.full((R, T, K), -1)
    elif mode == "dense_dups":  # few experts, many repeats
        idx = rng.integers(0, min(E, 2), size=(R, T, K))
    else:
        raise ValueError(mode)
    idx = idx.astype(np.int64)
    if mode != "empty":
        idx = np.where(rng.random(idx.shape) < p_neg, -1, idx)
    if p_invalid > 0:
        bad = rng.random(idx.shape) < p_invalid
        choices = np.array(list(_INVALID_VALUES) + [E, E + 1, E + 1000], dtype=np.int64)
        idx = np.where(bad, rng.choice(choices, size=idx.shape), idx)
    return idx.astype(np.int32)


def make_x(rng: np.random.Generator, shape, dtype) -> np.ndarray:
    return rng.standard_normal(shape, dtype=np.float32).astype(dtype)


def make_fp8_pair(rng: np.random.Generator, shape) -> tuple[np.ndarray, np.ndarray]:
    """A random FP8 payload (e4m3 [..., H], scales f32 [..., H/128]) (any bit patterns that are not NaN)."""
    q = rng.standard_normal(shape, dtype=np.float32).astype(E4M3)
    scales = rng.uniform(0.01, 4.0, size=tuple(shape[:-1]) + (shape[-1] // FP8_GROUP,)).astype(F32)
    return q, scales


def silu_mul(gate_up: np.ndarray) -> np.ndarray:
    """SwiGLU's elementwise step in float64 (jax_ep.grouped_activation rounds it once from float32): gate_up
    [M, 2F], the gate's F columns then the up's -> gate * sigmoid(gate) * up [M, F]."""
    gate, up = np.split(np.asarray(gate_up, np.float64), 2, axis=-1)
    return gate / (1 + np.exp(-gate)) * up


def silu_mul_vjp(gate_up: np.ndarray, dh: np.ndarray) -> np.ndarray:
    """The cotangent of gate_up [M, 2F] for dh [M, F], in float64: d gate = dh * up * s * (1 + gate * (1 - s)),
    d up = dh * gate * s, s = sigmoid(gate) (the derivative of gate * s is s + gate * s * (1 - s))."""
    gate, up = np.split(np.asarray(gate_up, np.float64), 2, axis=-1)
    dh = np.asarray(dh, np.float64)
    s = 1 / (1 + np.exp(-gate))
    return np.concatenate([dh * up * (s + gate * s * (1 - s)), dh * gate * s], axis=-1)


def grouped_swiglu(x, w_gate_up, w_down, cotangent, group_of_row):
    """float64: y, and the pullback of `cotangent` to x, W_gate_up [G, D, 2F] and W_down [G, F, D], row i taking
    expert group_of_row[i]'s weights."""
    x, cotangent = np.asarray(x, np.float64), np.asarray(cotangent, np.float64)
    wg, wd = np.asarray(w_gate_up, np.float64)[group_of_row], np.asarray(w_down, np.float64)[group_of_row]
    gate_up = np.einsum("md,mdf->mf", x, wg)
    h = silu_mul(gate_up)
    y = np.einsum("mf,mfd->md", h, wd)
    dh = np.einsum("md,mfd->mf", cotangent, wd)
    d_gate_up = silu_mul_vjp(gate_up, dh)
    groups = w_gate_up.shape[0]
    dwg = np.stack([x[group_of_row == g].T @ d_gate_up[group_of_row == g] for g in range(groups)])
    dwd = np.stack([h[group_of_row == g].T @ cotangent[group_of_row == g] for g in range(groups)])
    return y, (np.einsum("mf,mdf->md", d_gate_up, wg), dwg, dwd)
