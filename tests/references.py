"""Test oracles: plain, slow implementations the library's fast code is held to.

Written for clarity, not speed; none of it is part of the installed package.

- ``greedy_groups_reference``, ``fill_bins_reference``, ``polish_steps_reference``: the Numba
  kernels of ``vlmshard.packing.kernels``, in plain Python.
- ``isf_groups_reference``: OmniBal's ISF as its repository writes it, for
  ``vlmshard.packing.algorithms.isf_groups`` (and the speed baseline of benchmarks/pack_bench.py).
"""

from __future__ import annotations

import numpy as np

from vlmshard.packing.algorithms import ISF_ITERATIONS, ISF_MARGIN


def greedy_groups_reference(tiles, tokens, order, qv, qt):
    groups: list[list[int]] = []
    for i in order:
        if groups and (sum(tiles[j] for j in groups[-1]) + tiles[i] <= qv
                       and sum(tokens[j] for j in groups[-1]) + tokens[i] <= qt):
            groups[-1].append(i)
        else:
            groups.append([i])
    return np.array([g for g, members in enumerate(groups) for _ in members], np.int64)


def fill_bins_reference(tiles, tokens, squares, qv, qt, mean_attn, n_bins):
    inv = (1.0 / qv if qv > 0 else 0.0, 1.0 / qt, 1.0 / mean_attn if mean_attn > 0 else 0.0)
    load = [[0, 0, 0.0] for _ in range(n_bins)]
    where = []
    for v, t, a in zip(tiles, tokens, squares):
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


def polish_steps_reference(items, offsets, tiles, tokens, squares, ranks, micro_batches, qt,
                           rounds):
    per_step = ranks * micro_batches
    swaps = 0

    def micro(b):
        return range(offsets[b], offsets[b + 1])

    for s in range((len(offsets) - 1) // per_step):
        first = s * per_step
        rank_micros = [range(first + r * micro_batches, first + (r + 1) * micro_batches)
                       for r in range(ranks)]

        def loads():
            ks = [[items[k] for b in rank_micros[r] for k in micro(b)] for r in range(ranks)]
            return ([sum(float(tokens[i]) for i in k) for k in ks],
                    [sum(squares[i] for i in k) for k in ks])

        L, A = loads()
        mean_l, mean_a = sum(L) / ranks, sum(A) / ranks
        if mean_l <= 0:
            continue

        def dev(r):
            return (L[r] - mean_l) / mean_l + (A[r] - mean_a) / mean_a

        def spread(lp, lq, ap, aq):
            return sum(((x - m) / m) ** 2 for x, m in
                       ((lp, mean_l), (lq, mean_l), (ap, mean_a), (aq, mean_a)))

        for _ in range(rounds):
            p = max(range(ranks), key=lambda r: (dev(r), -r))
            best = None
            for q in range(ranks):
                if q == p:
                    continue
                before = spread(L[p], L[q], A[p], A[q])
                for bi in rank_micros[p]:
                    li = sum(tokens[items[k]] for k in micro(bi))
                    for bj in rank_micros[q]:
                        lj = sum(tokens[items[k]] for k in micro(bj))
                        for i in micro(bi):
                            for j in micro(bj):
                                ti, tj = tokens[items[i]], tokens[items[j]]
                                d = tj - ti
                                if tiles[items[i]] != tiles[items[j]] or d == 0:
                                    continue
                                if li + d > qt or lj - d > qt:
                                    continue
                                da = squares[items[j]] - squares[items[i]]
                                gain = before - spread(L[p] + d, L[q] - d, A[p] + da, A[q] - da)
                                if gain > (best[0] if best else 1e-12):
                                    best = (gain, i, j)
            if best is None:
                break
            _, i, j = best
            items[i], items[j] = items[j], items[i]
            L, A = loads()
            swaps += 1
    return swaps


def isf_groups_reference(tiles, tokens, ids, qv, qt, *, seed, iterations=ISF_ITERATIONS):
    """OmniBal's ISF in plain Python lists, as its repository writes it (minus its bugs: it never
    drops a sample). Also the speed baseline in benchmarks/pack_bench.py."""

    def random_groups(samples, s):
        index = list(range(len(samples)))
        np.random.RandomState(s).shuffle(index)
        groups, group, v_sum, t_sum = [], [], 0, 0
        for k in index:
            idx, v, t = samples[k]
            v_sum += v
            t_sum += t
            if group and (v_sum > qv or t_sum > qt):
                groups.append(group)
                group, v_sum, t_sum = [], v, t
            group.append(samples[k])
        if group:
            groups.append(group)
        return groups

    groups = random_groups([[int(i), int(tiles[i]), int(tokens[i])] for i in ids], seed)
    output = []
    for i in range(iterations - 1):
        pending = []
        for g in groups:
            if sum(s[1] for s in g) == qv or sum(s[2] for s in g) >= qt - ISF_MARGIN:
                output.append(g)
            else:
                pending.extend(g)
        groups = random_groups(pending, seed + i)
    output.extend(groups)
    return [[s[0] for s in g] for g in output]
