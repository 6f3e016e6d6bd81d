"""Pipeline partition search and per-stage recompute against brute force."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vlmshard.train.partition import (LayerCost, Machine, PartitionError, brute_force_partition,
                             choose_recompute, greedy_anchor, omnibal_candidates,
                             search_partition, stage_memory)

layer = st.builds(
    lambda f, b, act, inp, out, par: LayerCost("L", f, b, act + inp, inp, out, par),
    st.floats(0.1, 5.0), st.floats(0.1, 10.0), st.integers(0, 1000), st.integers(0, 200),
    st.integers(0, 500), st.integers(0, 800))


@settings(max_examples=150, deadline=None)
@given(st.lists(layer, min_size=1, max_size=8), st.integers(1, 4), st.integers(500, 6000),
       st.floats(10.0, 1e4))
def test_search_equals_brute_force(layers, stages, budget, link):
    machine = Machine(memory_budget=budget, link_bytes_per_s=link)
    if stages > len(layers):
        with pytest.raises(PartitionError, match="would leave a stage empty"):
            search_partition(layers, stages, machine)
        return
    try:
        expected = brute_force_partition(layers, stages, machine)
    except PartitionError:
        with pytest.raises(PartitionError, match="even with full recompute"):
            search_partition(layers, stages, machine)
        return
    found = search_partition(layers, stages, machine)
    assert found.max_time_s == pytest.approx(expected.max_time_s, rel=1e-9)
    assert found.bounds[0] == 0 and found.bounds[-1] == len(layers)
    assert all(a < b for a, b in zip(found.bounds, found.bounds[1:]))
    assert all(s.memory_bytes <= budget for s in found.stages)


@settings(max_examples=200, deadline=None)
@given(st.lists(layer, min_size=1, max_size=7), st.integers(1, 4), st.integers(0, 8000))
def test_recompute_is_the_fewest_layers_that_fit(layers, in_flight, budget):
    n = len(layers)
    chosen = choose_recompute(layers, 0, n, in_flight, budget)
    fits = {k: [c for c in itertools.combinations(range(n), k)
                if stage_memory(layers, 0, n, in_flight, list(c)) <= budget]
            for k in range(n + 1)}
    if chosen is None:
        assert not any(fits.values())
        return
    assert stage_memory(layers, 0, n, in_flight, chosen) <= budget
    fewest = min(k for k, sets in fits.items() if sets)
    assert len(chosen) == fewest
    assert stage_memory(layers, 0, n, in_flight, chosen) == min(
        stage_memory(layers, 0, n, in_flight, list(c)) for c in fits[fewest])


def test_recompute_counts_the_activation_it_rebuilds():
    # Recomputing A saves the most kept bytes, but rebuilding A's 800 then overflows: B alone
    # fits (2 × (800 + 0) + 590 = 2190), which a largest-saving-first greedy choice misses.
    a = LayerCost("A", 1.0, 2.0, 800, 200, 10, 0)
    b = LayerCost("B", 1.0, 2.0, 590, 0, 10, 0)
    assert choose_recompute([a, b], 0, 2, 2, 2200) == [1]


def test_first_stages_hold_more_micro_batches_so_recompute_more():
    same = [LayerCost(f"L{i}", 1.0, 2.0, 100, 10, 10, 0) for i in range(8)]
    part = search_partition(same, 4, Machine(memory_budget=500))
    assert [len(s.recompute) for s in part.stages] == sorted(
        (len(s.recompute) for s in part.stages), reverse=True)
    assert len(part.stages[0].recompute) > len(part.stages[-1].recompute)


def test_omnibal_candidates_start_from_the_anchor_and_fit():
    layers = [LayerCost(f"L{i}", 1.0 + (i % 3), 2.0, 50, 5, 5, 10) for i in range(12)]
    machine = Machine(memory_budget=10_000)
    assert greedy_anchor([1.0] * 12, 4) == [0, 3, 6, 9, 12]
    found = omnibal_candidates(layers, 4, machine, radius=1)
    assert found and all(len(p.stages) == 4 for p in found)
    exact = search_partition(layers, 4, machine)
    assert found[0].max_time_s >= exact.max_time_s - 1e-12
