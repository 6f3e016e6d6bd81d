"""The packer's hot loops, written for Numba (``compiled.py`` compiles them).

Each loop has a pure-Python twin written for clarity, not speed, in ``tests/references.py``;
the tests hold each kernel to its twin on random inputs, so a change to one without the other
fails. Everything that is not a loop over samples stays in NumPy in ``algorithms.py``.

Conventions: ``tiles`` and ``tokens`` are int64 arrays of per-sample ViT tiles and LLM
sequence length; caps are ``qv`` (tiles) and ``qt`` (tokens) per micro-batch; no sample passed in
is over a cap on its own (the caller lists those as unplaced first).
"""

from __future__ import annotations

import numpy as np


def greedy_groups(tiles, tokens, order, qv, qt):
    """Cut ``order`` into consecutive groups, opening a new one when a cap would be exceeded.

    This is OmniBal's ISF grouping step. Returns the group number of each position of ``order``.
    """
    n = order.shape[0]
    group = np.empty(n, np.int64)
    g = 0
    v_sum = 0
    t_sum = 0
    for k in range(n):
        i = order[k]
        v = tiles[i]
        t = tokens[i]
        if k > 0 and (v_sum + v > qv or t_sum + t > qt):
            g += 1
            v_sum = 0
            t_sum = 0
        v_sum += v
        t_sum += t
        group[k] = g
    return group


def fill_bins(tiles, tokens, squares, qv, qt, mean_attn, n_bins):
    """Place samples, in the given order, into ``n_bins`` micro-batches by worst fit.

    Each sample goes to the micro-batch that is least loaded after taking it, load being the
    largest of its tile fill (of Qv), token fill (of Qt) and Σ``squares`` (each sample's quadratic
    attention work, ``CostModel.squares``) relative to ``mean_attn``, a soft target; ties go to the
    lower index. Samples that fit nowhere get -1.
    Fed largest first, worst fit grows all micro-batches evenly, spreads long samples, and
    leaves the small samples to close the last gaps on both resources at once.
    """
    n = tiles.shape[0]
    inv_v = 1.0 / qv if qv > 0 else 0.0
    inv_t = 1.0 / qt
    inv_a = 1.0 / mean_attn if mean_attn > 0 else 0.0
    v_load = np.zeros(n_bins, np.int64)
    t_load = np.zeros(n_bins, np.int64)
    a_load = np.zeros(n_bins, np.float64)
    where = np.full(n, -1, np.int64)
    for i in range(n):
        v = tiles[i]
        t = tokens[i]
        a = squares[i]
        best = -1
        best_score = np.inf
        for b in range(n_bins):
            nv = v_load[b] + v
            nt = t_load[b] + t
            if nv <= qv and nt <= qt:
                score = max(max(nv * inv_v, nt * inv_t), (a_load[b] + a) * inv_a)
                if best < 0 or score < best_score:
                    best_score = score
                    best = b
        if best >= 0:
            v_load[best] += v
            t_load[best] += t
            a_load[best] += a
            where[i] = best
    return where


def polish_steps(items, offsets, tiles, tokens, squares, ranks, micro_batches, qt, rounds):
    """Even out tokens and attention across a step's ranks by swapping samples in place (micro-
    batches in step-major order, ``Packing``); returns the number of swaps. Per step, up to
    ``rounds`` times, the rank most above the mean (relative tokens + relative Σ``squares``)
    swaps two samples of equal tiles with the rank that most lowers Σ_r (ΔL_r/L̄)² + (ΔA_r/Ā)²,
    keeping Qt: tiles per micro-batch, so ViT balance and caps, never change."""
    per_step = ranks * micro_batches
    n_steps = (offsets.shape[0] - 1) // per_step
    L = np.zeros(ranks)
    A = np.zeros(ranks)
    swaps = 0
    for s in range(n_steps):
        first = s * per_step
        for r in range(ranks):
            L[r] = 0.0
            A[r] = 0.0
            for k in range(offsets[first + r * micro_batches],
                           offsets[first + (r + 1) * micro_batches]):
                L[r] += float(tokens[items[k]])
                A[r] += squares[items[k]]
        mean_l = L.sum() / ranks
        mean_a = A.sum() / ranks
        if mean_l <= 0.0:
            continue
        for _ in range(rounds):
            p = 0
            dev_p = (L[0] - mean_l) / mean_l + (A[0] - mean_a) / mean_a
            for r in range(1, ranks):
                dev = (L[r] - mean_l) / mean_l + (A[r] - mean_a) / mean_a
                if dev > dev_p:
                    p = r
                    dev_p = dev
            best_gain = 1e-12
            best_i = -1
            best_j = -1
            best_q = -1
            for q in range(ranks):
                if q == p:
                    continue
                before = (((L[p] - mean_l) / mean_l) ** 2 + ((L[q] - mean_l) / mean_l) ** 2
                          + ((A[p] - mean_a) / mean_a) ** 2 + ((A[q] - mean_a) / mean_a) ** 2)
                for bi in range(first + p * micro_batches, first + (p + 1) * micro_batches):
                    li = 0
                    for k in range(offsets[bi], offsets[bi + 1]):
                        li += tokens[items[k]]
                    for bj in range(first + q * micro_batches, first + (q + 1) * micro_batches):
                        lj = 0
                        for k in range(offsets[bj], offsets[bj + 1]):
                            lj += tokens[items[k]]
                        for i in range(offsets[bi], offsets[bi + 1]):
                            for j in range(offsets[bj], offsets[bj + 1]):
                                if tiles[items[i]] != tiles[items[j]]:
                                    continue
                                ti = tokens[items[i]]
                                tj = tokens[items[j]]
                                d = tj - ti  # rank p gains d tokens, rank q loses them
                                if d == 0 or li + d > qt or lj - d > qt:
                                    continue
                                da = squares[items[j]] - squares[items[i]]
                                after = (((L[p] + d - mean_l) / mean_l) ** 2
                                         + ((L[q] - d - mean_l) / mean_l) ** 2
                                         + ((A[p] + da - mean_a) / mean_a) ** 2
                                         + ((A[q] - da - mean_a) / mean_a) ** 2)
                                if before - after > best_gain:
                                    best_gain = before - after
                                    best_i = i
                                    best_j = j
                                    best_q = q
            if best_i < 0:
                break
            d = float(tokens[items[best_j]]) - float(tokens[items[best_i]])
            da = squares[items[best_j]] - squares[items[best_i]]
            L[p] += d
            L[best_q] -= d
            A[p] += da
            A[best_q] -= da
            items[best_i], items[best_j] = items[best_j], items[best_i]
            swaps += 1
    return swaps


# Each loop's Numba signature: the kernels are compiled ahead of time for exactly these types.
SIGNATURES = {
    "greedy_groups": "i8[:](i8[:], i8[:], i8[:], i8, i8)",
    "fill_bins": "i8[:](i8[:], i8[:], f8[:], i8, i8, f8, i8)",
    "polish_steps": "i8(i8[:], i8[:], i8[:], i8[:], f8[:], i8, i8, i8, i8)",
}
