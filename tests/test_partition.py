"""Pipeline partition search and per-stage recompute against an exhaustive search written here
from the stage model (vlmshard/partition.py's docstring), not from its functions."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vlmshard.errors import ConfigError
from vlmshard.partition import (
    LayerCost,
    Machine,
    PartitionError,
    choose_recompute,
    evaluate,
    greedy_anchor,
    largest_micro_batch_scale,
    omnibal_candidates,
    search_partition,
)

layer = st.builds(
    lambda f, b, act, inp, out, par, peak: LayerCost("L", f, b, act + inp, inp, out, par, peak),
    st.floats(0.1, 5.0), st.floats(0.1, 10.0), st.integers(0, 1000), st.integers(0, 200),
    st.integers(0, 500), st.integers(0, 800), st.integers(0, 1500))
# a layer that may have a selective mode, keeping its input and a share of the rest (percent)
selective_layer = st.builds(
    lambda f, act, inp, par, peak, share: LayerCost(
        "L", f, 2 * f, act + inp, inp, 0, par, peak,
        selective_bytes=None if share is None else inp + act * share // 100),
    st.floats(0.1, 5.0), st.integers(0, 1000), st.integers(0, 200), st.integers(0, 800),
    st.integers(0, 1500), st.none() | st.integers(0, 100))


# --- the stage model, written out again ----------------------------------------------------------
# Stage s of P over layers [first, end), recomputing the set R, under 1F1B:
#   memory = Σ params + (P − s) · Σ (input if recomputed else activation) + max activation in R
#            + max over the stage of (peak − activation, or 0): what a layer needs while it runs
#   (a layer recomputed selectively, of those in S not in R, keeps its selective bytes instead,
#   and its transient is peak − selective bytes: it rebuilds the rest as it runs)
#   time   = Σ (forward + backward) + Σ_R forward + output bytes of its last layer / link
#            (not last)
# The recompute a stage gets is the fewest layers that fit the budget, of those the least memory.

def _memory(layers, first, end, in_flight, recompute, selective=()) -> int:
    total = transient = 0
    for i in range(first, end):
        lay = layers[i]
        if i in recompute:
            kept, unrebuilt = lay.input_bytes, lay.activation_bytes
        elif i in selective and lay.selective_bytes is not None:
            kept = unrebuilt = lay.selective_bytes
        else:
            kept = unrebuilt = lay.activation_bytes
        total += lay.param_bytes + in_flight * kept
        transient = max(transient, lay.peak_bytes - unrebuilt)
    return total + max([layers[i].activation_bytes for i in recompute] or [0]) + transient


def _time(layers, first, end, recompute, link, last) -> float:
    t = sum(layers[i].forward_s + layers[i].backward_s for i in range(first, end))
    t += sum(layers[i].forward_s for i in recompute)
    return t + (0.0 if last else layers[end - 1].output_bytes / link)


def _admissible(layers, first, end, in_flight, budget, selective=()) -> list[tuple[int, ...]]:
    """Every recompute set of [first, end) the rule allows (the layers ``selective`` recomputed
    selectively where not whole): of the subsets that fit, those with the fewest layers, and of
    those the least memory (ties all returned). Empty if none fits."""
    span = range(first, end)
    for k in range(len(span) + 1):
        fits = [(m, c) for c in itertools.combinations(span, k)
                if (m := _memory(layers, first, end, in_flight, c, selective)) <= budget]
        if fits:
            least = min(m for m, _ in fits)
            return [c for m, c in fits if m == least]
    return []


def _exhaustive(layers, stages, budget, link) -> tuple[float, float] | None:
    """(lo, hi): the optimum max-stage time over every split into non-empty contiguous stages,
    with each stage's time taken at its fastest (lo) and slowest (hi) admissible recompute set
    (equal unless the rule has ties). None if no split fits."""
    n, lo_best, hi_best = len(layers), float("inf"), float("inf")
    for cuts in itertools.combinations(range(1, n), stages - 1):
        bounds = [0, *cuts, n]
        lo = hi = 0.0
        for s, (first, end) in enumerate(zip(bounds, bounds[1:])):
            sets = _admissible(layers, first, end, stages - s, budget)
            if not sets:
                break
            times = [_time(layers, first, end, c, link, s == stages - 1) for c in sets]
            lo, hi = max(lo, min(times)), max(hi, max(times))
        else:
            lo_best, hi_best = min(lo_best, lo), min(hi_best, hi)
    return None if lo_best == float("inf") else (lo_best, hi_best)


@settings(max_examples=150, deadline=None)
@given(st.lists(layer, min_size=1, max_size=8), st.integers(1, 4), st.integers(500, 6000),
       st.floats(10.0, 1e4))
def test_search_equals_exhaustive_search(layers, stages, budget, link):
    machine = Machine(memory_budget=budget, link_bytes_per_s=link)
    if stages > len(layers):
        with pytest.raises(PartitionError, match="would leave a stage empty"):
            search_partition(layers, stages, machine)
        return
    expected = _exhaustive(layers, stages, budget, link)
    if expected is None:
        with pytest.raises(PartitionError, match="even with full recompute"):
            search_partition(layers, stages, machine)
        return
    found = search_partition(layers, stages, machine)
    lo, hi = expected
    assert lo - 1e-9 <= found.max_time_s <= hi + 1e-9  # == the optimum when the rule has no ties
    n = len(layers)
    assert found.bounds[0] == 0 and found.bounds[-1] == n and len(found.bounds) == stages + 1
    assert all(a < b for a, b in zip(found.bounds, found.bounds[1:]))
    # each stage as reported is what the model says for its bounds and recompute set
    for s, (stage, first, end) in enumerate(zip(found.stages, found.bounds, found.bounds[1:])):
        assert (stage.first, stage.end) == (first, end)
        assert tuple(stage.recompute) in _admissible(layers, first, end, stages - s, budget)
        assert stage.memory_bytes == _memory(layers, first, end, stages - s, stage.recompute)
        assert stage.memory_bytes <= budget
        assert stage.time_s == pytest.approx(
            _time(layers, first, end, stage.recompute, link, s == stages - 1), rel=1e-12)


@settings(max_examples=200, deadline=None)
@given(st.lists(layer, min_size=1, max_size=7), st.integers(1, 4), st.integers(0, 8000))
def test_recompute_is_the_fewest_layers_that_fit(layers, in_flight, budget):
    n = len(layers)
    chosen = choose_recompute(layers, 0, n, in_flight, budget)
    allowed = _admissible(layers, 0, n, in_flight, budget)
    if not allowed:
        assert chosen is None
        return
    assert tuple(chosen) in allowed


@settings(max_examples=200, deadline=None)
@given(st.lists(selective_layer, min_size=1, max_size=6), st.integers(1, 4),
       st.integers(0, 8000))
def test_whole_layers_beside_selective_ones_are_the_fewest_that_fit(layers, in_flight, budget):
    """The whole layers ``choose_selective`` adds when selective recompute is not enough: a
    whole layer keeps its input, rebuilds its full activation and has its own transient, not
    the larger one it has recomputed selectively."""
    n = len(layers)
    selective = [i for i, c in enumerate(layers) if c.selective_bytes is not None]
    chosen = choose_recompute(layers, 0, n, in_flight, budget, selective)
    allowed = _admissible(layers, 0, n, in_flight, budget, selective)
    if not allowed:
        assert chosen is None
        return
    assert tuple(chosen) in allowed


@settings(max_examples=150, deadline=None)
@given(st.lists(selective_layer, min_size=1, max_size=6), st.integers(1, 3),
       st.integers(500, 6000))
def test_the_search_finds_a_partition_where_full_recompute_fits_one(layers, stages, budget):
    """Where recomputing every layer whole fits some partition, the search (selective
    recompute first) finds one: its error, which says no partition fits even so, is true.
    (Not the converse: rebuilding a layer can cost more than keeping it.)"""
    n = len(layers)
    if stages > n:
        return
    fits = any(all(_memory(layers, first, end, stages - s, range(first, end)) <= budget
                   for s, (first, end) in enumerate(zip(bounds, bounds[1:])))
               for cuts in itertools.combinations(range(1, n), stages - 1)
               for bounds in [[0, *cuts, n]])
    try:
        found = search_partition(layers, stages, Machine(memory_budget=budget))
    except PartitionError as e:
        assert not fits, e
        return
    for s, stage in enumerate(found.stages):
        assert stage.memory_bytes == _memory(layers, stage.first, stage.end, stages - s,
                                             stage.recompute, stage.selective) <= budget


def test_a_stage_fits_by_recomputing_its_selective_layers_whole_by_hand():
    """Layers A and B keep 100 units, 10 of input, 40 recomputed selectively, and peak at 100
    (no transient as they are; selectively 60, the rest rebuilt); C keeps 20, 10 of input, has
    no selective mode and 60 of parameters. Two stages, 150 units each: stage 0 holds 2
    micro-batches, stage 1 one.
    - [A B | C]: stage 0 as it is 2 x 200 = 400; A selective 2 x 140 + 60 = 340; both
      selective 2 x 80 + 60 = 220; A whole, B selective 2 x 50 + 100 rebuilt + B's 60 = 260;
      both whole 2 x 20 + 100 = 140: fits (counting the selective transient of 60 too, 200,
      it would not). Stage 1: 60 + 20 = 80.
    - [A | B C]: stage 1 as it is 60 + 100 + 20 = 180; B selective 60 + 40 + 20 + 60 = 180;
      B whole 60 + 10 + 20 + 100 = 190; B and C whole 60 + 10 + 10 + 100 = 180; C whole, B
      selective 60 + 40 + 10 + 20 + 60 = 190: none fits.
    So the one partition is [0, 2, 3], A and B recomputed whole: 1 + 2 s each and their
    forwards again, 8 s. At 130 units none fits, and the error names [A B | C]'s stage 0,
    140 units with every layer recomputed ([A | B C]'s fullest needs 180)."""
    unit = 2**30 // 100
    a = LayerCost("A", 1.0, 2.0, 100 * unit, 10 * unit, 0, 0, 100 * unit,
                  selective_bytes=40 * unit)
    c = LayerCost("C", 1.0, 2.0, 20 * unit, 10 * unit, 0, 60 * unit, 20 * unit)
    layers = [a, replace(a, name="B"), c]
    found = search_partition(layers, 2, Machine(150 * unit))
    assert found.bounds == [0, 2, 3]
    assert [(s.recompute, s.selective, s.memory_bytes) for s in found.stages] == [
        ([0, 1], [], 140 * unit), ([], [], 80 * unit)]
    assert found.max_time_s == pytest.approx(8.0)
    assert evaluate(layers, [0, 1, 3], Machine(150 * unit)) is None
    with pytest.raises(PartitionError, match=r"the best leaves stage 0 \(layers A to B\) "
                                             r"needing 1\.40 GiB .* above the 1\.30 GiB"):
        search_partition(layers, 2, Machine(130 * unit))


def test_recompute_counts_the_activation_it_rebuilds():
    # Recomputing A saves the most kept bytes, but rebuilding A's 800 then overflows: B alone
    # fits (2 × (800 + 0) + 590 = 2190), which a largest-saving-first greedy choice misses.
    a = LayerCost("A", 1.0, 2.0, 800, 200, 10, 0)
    b = LayerCost("B", 1.0, 2.0, 590, 0, 10, 0)
    assert choose_recompute([a, b], 0, 2, 2, 2200) == [1]


def test_the_largest_micro_batch_a_partition_holds_by_hand():
    # Stage 0 of 2 holds 2 micro-batches of layer a: 1000 + 2 x 100k bytes kept, or, recomputing
    # a, 1000 + 2 x 10k + 100k rebuilt = 1000 + 120k; stage 1 holds 1 of layer b: 1000 + 200k
    # (recomputing b would need 1000 + 20k + 200k). With 25,000 bytes: stage 0 fits up to
    # k = 200, stage 1 up to k = 120, so a micro-batch may be 120 times the profiled one.
    a = LayerCost("a", 1.0, 2.0, 100, 10, 5, 1000)
    b = LayerCost("b", 1.0, 2.0, 200, 20, 5, 1000)
    scale = largest_micro_batch_scale([a, b], [0, 1, 2], Machine(memory_budget=25_000))
    assert scale == pytest.approx(120, rel=1e-6)
    assert largest_micro_batch_scale([a, b], [0, 1, 2], Machine(memory_budget=999)) == 0.0
    free = LayerCost("free", 1.0, 2.0, 0, 0, 0, 10)
    assert largest_micro_batch_scale([free, free], [0, 1, 2], Machine(1000)) == float("inf")


@pytest.mark.parametrize("preset, stages", [("qwen2-vl-2b", 1), ("internvl2-2b", 2),
                                           ("qwen3-vl-8b", 4)])
def test_the_largest_micro_batch_of_the_analytic_model_is_the_edge_of_fitting(preset, stages):
    """``largest_micro_batch`` (the caps' memory bound before any profile): a micro-batch of its
    size fits some partition of the real model's analytic layers on an 80 GiB device, one 1%
    larger fits none (an 8B model's states alone fill one device: four stages); the loss's
    chunk is costed at each size, not scaled from one. Likewise the largest that recomputes no
    layer whole (``whole_recompute=False``)."""
    from vlmshard.families import presets
    from vlmshard.model_sizes import CostTerms, bytes_per_param, layer_work
    from vlmshard.partition import analytic_layer_costs, largest_micro_batch

    work = layer_work(presets()[preset])
    machine = Machine.for_device(80 * 2**30)
    shape = CostTerms(10.0, 40.0)
    largest = largest_micro_batch(work, shape, machine, bytes_per_param("bf16"), stages)
    assert largest.tokens > 1000 and largest.tiles == pytest.approx(largest.tokens / 4)

    def costs(size):
        return analytic_layer_costs(work, time_size=size, memory_size=size, flops_per_s=1.0,
                                    bytes_per_param=bytes_per_param("bf16"))

    search_partition(costs(largest), stages, machine)
    with pytest.raises(PartitionError):
        search_partition(costs(largest.scaled(1.01)), stages,
                         machine)
    # without recomputing any layer whole: the searched partition at that size has none, at
    # 1% more it has some
    free = largest_micro_batch(work, shape, machine, bytes_per_param("bf16"), stages,
                               whole_recompute=False)
    assert 0 < free.tokens < largest.tokens
    assert not search_partition(costs(free), stages, machine).recompute
    assert search_partition(costs(free.scaled(1.01)), stages,
                            machine).recompute


def test_selective_recompute_comes_before_whole_layers_by_hand():
    """Layers A (keeps 100, 40 selectively), B (80, 50) and C (60, no selective mode), inputs
    of 10, no transient, one micro-batch in flight. A selective layer keeps its selective bytes
    and rebuilds the rest in its backward (a transient: A's 60, B's 30). Stage memory: kept +
    the largest rebuilt whole layer + the largest transient.
    - 240: fits as it is.
    - 230: A selective keeps 40 + 80 + 60 = 180, + A's 60 rebuilt = 240, too much; A and B
      selective 40 + 50 + 60 = 150 + 60 = 210: both, no whole layer.
    - 200: both selective is 210; then the fewest whole layers on top: one is not enough (A:
      10 + 50 + 60 + its full 100 rebuilt + B's 30 = 250; B: 40 + 10 + 60 + 80 + A's 60 = 250;
      C: 40 + 50 + 10 + 60 + 60 = 220), two are: A and C 10 + 50 + 10 + 100 + B's 30 = 200,
      B and C 40 + 10 + 10 + 80 + A's 60 = 200, and the least, A and B: 10 + 10 + 60 + 100,
      no transient left (a whole layer has its own, none) = 180.
    - 100: even all three whole need 10 + 10 + 10 + 100 = 130."""
    from vlmshard.partition import make_stage, stage_memory

    layers = [LayerCost("A", 1.0, 2.0, 100, 10, 10, 0, 100, selective_bytes=40),
              LayerCost("B", 1.0, 2.0, 80, 10, 10, 0, 80, selective_bytes=50),
              LayerCost("C", 1.0, 2.0, 60, 10, 10, 0, 60)]
    for budget, whole, selective, memory in ((240, [], [], 240), (230, [], [0, 1], 210),
                                             (215, [], [0, 1], 210), (200, [0, 1], [], 180)):
        stage = make_stage(layers, 0, 3, 0, 1, Machine(memory_budget=budget))
        assert (stage.recompute, stage.selective, stage.memory_bytes) == (
            whole, selective, memory), budget
        assert stage_memory(layers, 0, 3, 1, whole, selective) == memory
        # selective recompute costs no matrix FLOPs: only the whole layers' forwards are added
        assert stage.time_s == pytest.approx(9.0 + len(whole))
    assert make_stage(layers, 0, 3, 0, 1, Machine(memory_budget=100)) is None


def test_first_stages_hold_more_micro_batches_so_recompute_more():
    same = [LayerCost(f"L{i}", 1.0, 2.0, 100, 10, 10, 0) for i in range(8)]
    part = search_partition(same, 4, Machine(memory_budget=500))
    assert [len(s.recompute) for s in part.stages] == sorted(
        (len(s.recompute) for s in part.stages), reverse=True)
    assert len(part.stages[0].recompute) > len(part.stages[-1].recompute)


def test_omnibal_candidates_by_hand():
    # Layers cost 3, 4, 5, 3, 4, 5, ... seconds (forward 1, 2, 3 + backward 2): 48 s in all, so
    # the greedy anchor [0, 3, 6, 9, 12] gives every stage exactly 12 s of compute, plus 5 bytes
    # over a 25 GB/s link for stages 0-2. Memory always fits (largest: 4 layers × 10 + 4 in
    # flight × 4 × 50 = 840 bytes), so nothing is recomputed and no candidate is dropped.
    layers = [LayerCost(f"L{i}", 1.0 + (i % 3), 2.0, 50, 5, 5, 10) for i in range(12)]
    machine = Machine(memory_budget=10_000)
    assert greedy_anchor([lay.forward_s + lay.backward_s for lay in layers], 4) == [0, 3, 6, 9, 12]
    found = omnibal_candidates(layers, 4, machine, radius=1)
    # radius 1: each inner cut moves by -1, 0 or +1 and the ranges {2,3,4}, {5,6,7}, {8,9,10}
    # never collide: 3³ = 27 candidates.
    assert sorted(tuple(p.bounds) for p in found) == sorted(
        (0, a, b, c, 12) for a in (2, 3, 4) for b in (5, 6, 7) for c in (8, 9, 10))
    assert found[0].bounds == [0, 3, 6, 9, 12]  # the only one with zero-ish time variance
    assert [s.time_s for s in found[0].stages] == pytest.approx([12 + 5 / 25e9] * 3 + [12.0])
    assert all(s.recompute == [] for p in found for s in p.stages)
    # The exact search reaches the same optimum, which no split can beat: 48 s over 4 stages.
    exact = search_partition(layers, 4, machine)
    assert exact.max_time_s == pytest.approx(12 + 5 / 25e9, rel=1e-12)
    # OmniBal ranks by stage-time variance: the runner-up moves one 3 s layer across a cut
    # (one stage 15 s, one 9 s: variance (3² + 3²) / 4 = 4.5), never a 5 s one (12.5).
    def variance(p):
        times = [s.time_s for s in p.stages]
        return sum((t - 12) ** 2 for t in times) / 4

    assert variance(found[1]) == pytest.approx(4.5, abs=1e-6)
    assert all(variance(a) <= variance(b) + 1e-6 for a, b in zip(found, found[1:]))


def test_a_devices_budget_leaves_out_context_nccl_and_fragmentation():
    """The one rule the profile and the simulator share: 80 GiB less 768 MiB of CUDA context and
    512 MiB of NCCL buffers, 90% of the rest."""
    assert Machine.for_device(80 * 2**30).memory_budget == int((80 - 1.25) * 2**30 * 0.9)
    with pytest.raises(ConfigError, match="leaves nothing"):
        Machine.for_device(2**30)


def test_a_partition_that_cannot_fit_names_a_stage_that_does_not():
    """Every layer alone fits, but two stages cannot hold four layers of 3 GB each with 5 GB a
    stage (by hand: the best split holds two layers, 6 GB, on its fullest stage): the message
    names that stage and its bytes, never a stage that fits."""
    from vlmshard.partition import LayerCost, Machine, PartitionError, search_partition

    layers = [LayerCost(f"layer_{i}", forward_s=1.0, backward_s=2.0, activation_bytes=0,
                        input_bytes=0, output_bytes=0, param_bytes=3 * 2**30) for i in range(4)]
    with pytest.raises(PartitionError, match=r"the best leaves stage \d \(layers layer_\d to "
                                             r"layer_\d\) needing 6\.00 GiB .* above the "
                                             r"5\.00 GiB a stage has"):
        search_partition(layers, 2, Machine(5 * 2**30))
