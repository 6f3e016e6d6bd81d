"""The packer's hot loops as Numba kernels, each beside a pure-Python reference.

Every kernel here has a ``*_reference`` twin written for clarity, not speed; the tests hold each
kernel to its twin on random inputs, so a change to one without the other fails. Everything that
is not a loop over samples stays in NumPy in ``algorithms.py``.

Conventions: ``tiles`` and ``tokens`` are int32/int64 arrays of per-sample ViT tiles and LLM
sequence length; caps are ``qv`` (tiles) and ``qt`` (tokens) per micro-batch; no sample passed in
is over a cap on its own (the caller lists those as unplaced first).
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True)
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


def greedy_groups_reference(tiles, tokens, order, qv, qt):
    groups: list[list[int]] = []
    for i in order:
        if groups and (sum(tiles[j] for j in groups[-1]) + tiles[i] <= qv
                       and sum(tokens[j] for j in groups[-1]) + tokens[i] <= qt):
            groups[-1].append(i)
        else:
            groups.append([i])
    return np.array([g for g, members in enumerate(groups) for _ in members], np.int64)


@njit(cache=True)
def fill_bins(tiles, tokens, qv, qt, mean_attn, n_bins):
    """Place samples, in the given order, into ``n_bins`` micro-batches by worst fit.

    Each sample goes to the micro-batch that is least loaded after taking it, load being the
    largest of its tile fill (of Qv), token fill (of Qt) and Σseq_len² relative to
    ``mean_attn``, a soft target; ties go to the lower index. Samples that fit nowhere get -1.
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
        a = float(t) * float(t)
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


def fill_bins_reference(tiles, tokens, qv, qt, mean_attn, n_bins):
    inv = (1.0 / qv if qv > 0 else 0.0, 1.0 / qt, 1.0 / mean_attn if mean_attn > 0 else 0.0)
    load = [[0, 0, 0.0] for _ in range(n_bins)]
    where = []
    for v, t in zip(tiles, tokens):
        a = float(t) * float(t)
        fits = [b for b in range(n_bins) if load[b][0] + v <= qv and load[b][1] + t <= qt]
        if not fits:
            where.append(-1)
            continue
        best = min(fits, key=lambda b: (max((load[b][0] + v) * inv[0], (load[b][1] + t) * inv[1],
                                            (load[b][2] + a) * inv[2]), b))
        load[best][0] += v
        load[best][1] += t
        load[best][2] += a
        where.append(best)
    return np.array(where, np.int64)
