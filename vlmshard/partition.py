"""Pipeline stage partition and per-stage activation recompute, from profiled layer costs.

Model of one stage s of P holding layers [first, end) under 1F1B:

- time = Σ (forward + backward) + Σ forward of the recomputed layers
  + the time to send its output activation to stage s + 1;
- memory = Σ parameter/optimizer bytes + (P − s) micro-batches in flight × Σ activation bytes
  kept for backward (a recomputed layer keeps only its input) + the largest recomputed layer's
  activations, rebuilt during backward one layer at a time + the largest transient a layer
  needs while it runs (its peak beyond what it keeps: measured by ``train profile``, else the
  analytic model's, ``model_sizes.LayerWork.transient``).

``choose_recompute`` picks, for one stage, the fewest layers to recompute so the stage fits the
memory budget: once the largest layer it rebuilds and the largest transient are fixed,
recomputing the layers that save the most first is optimal for the count, since any k layers
save at most the k largest savings. ``search_partition`` is the exact min-max
contiguous partition by dynamic programming over (stage, first layer), each stage costed with
the recompute it then needs (tests/test_partition.py holds it to an exhaustive search).
``omnibal_candidates`` is OmniBal's neighbourhood search around the greedy anchor, ranked by
stage-time variance, then boundary communication.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field, fields, replace
from functools import cached_property, lru_cache

from vlmshard.errors import ConfigError
from vlmshard.model_sizes import (
    CHECKPOINT_STATE_BYTES,
    LayerWork,
    CostTerms,
    kept_bytes,
    forward_flops,
    layer_training_flops,
    held_transient,
)


@dataclass(frozen=True)
class LayerCost:
    """Profiled cost of one pipeline layer for one micro-batch."""

    name: str
    forward_s: float
    backward_s: float
    activation_bytes: int  # kept for backward when not recomputed
    input_bytes: int  # kept instead when the layer is recomputed (its input checkpoint)
    output_bytes: int  # sent to the next stage when a stage ends after this layer
    param_bytes: int  # parameters, gradients and optimizer states
    # the most the layer's forward and backward held at once above what was allocated before
    # it ran, its parameters' gradients aside (measured, or the analytic model's): beyond its
    # kept activation, a transient the stage needs room for while the layer runs
    peak_bytes: int = 0
    # kept under selective recompute (its matmuls' and attention's outputs, and its input:
    # ``vlmshard.train.recompute``); None: the layer has no selective mode
    selective_bytes: int | None = None
    # of ``param_bytes``, those of the table a tied LM head and the token embedding share: a
    # stage holding both holds it once (``stage_param_bytes``)
    tied_bytes: int = 0
    # False for a frozen layer before any trained one: forward only, nothing to recompute
    has_backward: bool = True

    @cached_property
    def transient_bytes(self) -> int:
        return max(0, self.peak_bytes - self.activation_bytes)

    @cached_property
    def selectively(self) -> "LayerCost":
        """This layer recomputed selectively: it keeps ``selective_bytes``, and its backward
        rebuilds the rest beside its transient, so its peak is unchanged. Made once: the
        search asks for it millions of times."""
        return replace(self, activation_bytes=self.selective_bytes, selective_bytes=None)

    @classmethod
    def from_dict(cls, d: dict) -> "LayerCost":
        """One layer of profile.json, which writes the analytic model's figures beside these."""
        return cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d})


# What a training process holds on its device besides the modelled tensors: the CUDA context
# with cuBLAS/cuDNN workspaces, NCCL's communication buffers, and the caching allocator's
# fragmentation (a share of the rest).
CUDA_CONTEXT_BYTES = 768 * 2**20
NCCL_BUFFER_BYTES = 512 * 2**20
FRAGMENTATION = 0.10


@dataclass(frozen=True)
class Machine:
    memory_budget: int  # bytes per pipeline stage for the modelled tensors
    link_bytes_per_s: float = 25e9  # stage-to-stage bandwidth
    full_recompute: bool = False  # recompute every layer (the usual baseline) instead of the fewest

    @classmethod
    def for_device(cls, device_bytes: int, link_bytes_per_s: float = 25e9,
                   full_recompute: bool = False) -> "Machine":
        """A device of ``device_bytes``: the budget left for weights, optimizer states and
        activations once the context, NCCL buffers and fragmentation are counted (the one rule
        the profile and the simulator share)."""
        usable = int((device_bytes - CUDA_CONTEXT_BYTES - NCCL_BUFFER_BYTES)
                     * (1 - FRAGMENTATION))
        if usable <= 0:
            raise ConfigError(f"{device_bytes / 2**30:.2f} GiB leaves nothing once the CUDA "
                              "context and NCCL buffers (1.25 GiB) are counted")
        return cls(usable, link_bytes_per_s, full_recompute)


@dataclass
class Stage:
    first: int
    end: int  # exclusive
    recompute: list[int] = field(default_factory=list)
    time_s: float = 0.0
    memory_bytes: int = 0
    selective: list[int] = field(default_factory=list)  # recomputed selectively


@dataclass
class Partition:
    """Stage boundaries (``bounds[s]`` .. ``bounds[s + 1]``), each stage's recompute and costs."""

    bounds: list[int]
    stages: list[Stage]

    @property
    def max_time_s(self) -> float:
        return max(s.time_s for s in self.stages)

    @property
    def recompute(self) -> list[int]:
        return [i for s in self.stages for i in s.recompute]

    @property
    def selective(self) -> list[int]:
        return [i for s in self.stages for i in s.selective]


def analytic_layer_costs(work: list[LayerWork], *, time_size: CostTerms, memory_size: CostTerms,
                         flops_per_s: float, bytes_per_param: float,
                         modes: list[str] | None = None,
                         frozen_bytes_per_param: float = 0.0) -> list[LayerCost]:
    """``LayerCost``s from the analytic model (``model_sizes.layer_work``) for the search: times
    at a typical micro-batch, memory (kept activations and the transient beyond them) at the
    largest one (the one that must fit). The first layer's input is the pixels its activation
    already keeps. ``modes``: per layer, how the run's recipe runs it (``vlmshard.recipe``;
    default: every layer trained): a frozen layer holds its weights alone
    (``frozen_bytes_per_param`` each), its backward computes its input's gradient alone, and a
    frozen prefix keeps nothing and has no backward; LoRA's adapters (``adapter_params``) are
    trained beside frozen weights."""
    costs = []
    for i, (w, mode) in enumerate(zip(work, modes or ["train"] * len(work))):
        w = replace(w, flops=w.flops.windows_as_full())
        forward = forward_flops(w, mode).dot(time_size) / flops_per_s
        backward = layer_training_flops(w, mode).dot(time_size) / flops_per_s - forward
        inputs = work[i - 1].output_bytes if i else w.activation_bytes
        kept, held = int(kept_bytes(w, mode).dot(memory_size)), int(inputs.dot(memory_size))
        selective = None if w.selective_bytes is None else min(
            kept, held + int(w.selective_bytes.dot(memory_size)) + CHECKPOINT_STATE_BYTES)
        if mode == "forward":  # nothing kept, nothing to recompute
            kept = held = 0
            selective = None
        per_param = bytes_per_param if mode == "train" else frozen_bytes_per_param
        costs.append(LayerCost(
            w.name, forward, backward, kept, held,
            int(w.output_bytes.dot(memory_size)),
            int(w.params * per_param + w.adapter_params * bytes_per_param),
            peak_bytes=kept + int(held_transient(w, mode, memory_size)),
            selective_bytes=selective,
            tied_bytes=int(w.tied_params * per_param), has_backward=mode != "forward"))
    return costs


class PartitionError(ConfigError):
    """No partition fits: the message says which stage and by how much."""


def choose_recompute(layers: list[LayerCost], first: int, end: int, in_flight: int,
                     budget: int, selective=()) -> list[int] | None:
    """Fewest layers of [first, end) to recompute whole so the stage fits ``budget`` (of those,
    the least memory), those at the indices ``selective`` recomputed selectively unless chosen;
    None if even recomputing every layer does not fit.

    Recomputing layer i whole saves ``in_flight × (kept − input)``, but the backward pass then
    rebuilds the largest recomputed activation, and a whole layer's transient is its own, not
    the one it has as it runs otherwise (a selective layer's includes its rebuild). So for each
    cap R on the rebuilt activation and level T on the largest transient, the set must hold
    every layer whose transient otherwise exceeds T, and the best set of k layers adds to those
    the largest savings among layers no larger than R; the answer is the best over R and T,
    the layers' sizes and transients. Exact, O(n²) per stage without selective layers."""
    span = range(first, end)
    left = dict(zip(span, with_selective(layers[first:end], [i - first for i in selective])))
    base = (stage_param_bytes(layers, first, end)
            + in_flight * sum(c.activation_bytes for c in left.values()))
    running = {i: c.transient_bytes for i, c in left.items()}  # the transient unless whole
    if base + max(running.values()) <= budget:
        return []
    saving = {i: in_flight * (c.activation_bytes - c.input_bytes) for i, c in left.items()}
    size = {i: layers[i].activation_bytes for i in span}
    floor = max(layers[i].transient_bytes for i in span)  # the transient with every layer whole
    by_saving = sorted(span, key=lambda i: (-saving[i], i))
    best: tuple[int, int, list[int]] | None = None  # (layers, memory, chosen)
    # a level or cap above the one the chosen set reaches only overstates its memory, which
    # the set's own level and cap, also tried, state exactly
    for level in sorted({floor, *(t for t in running.values() if t > floor)}, reverse=True):
        forced = [i for i in span if running[i] > level]
        if best and len(forced) > best[0]:
            break  # a lower level forces at least these: it cannot win
        for cap in sorted(set(size.values()), reverse=True):  # most choice first: best soonest
            if any(size[i] > cap for i in forced):
                break
            chosen = list(forced)
            memory = base + cap + level - sum(saving[i] for i in forced)
            for i in by_saving:
                if memory <= budget or (best and len(chosen) > best[0]):
                    break  # fits, or already more layers than the best: it cannot win
                if running[i] <= level and size[i] <= cap:
                    chosen.append(i)
                    memory -= saving[i]
            if memory <= budget and (best is None or (len(chosen), memory) < best[:2]):
                best = (len(chosen), memory, sorted(chosen))
    return None if best is None else best[2]


def stage_param_bytes(layers: list[LayerCost], first: int, end: int) -> int:
    """The parameters (with their gradients and optimizer states) of the layers [first, end):
    the table a tied LM head and the token embedding share once where the stage holds both
    (one module, as DeepSpeed's tied layers are on one stage), a copy on each stage otherwise."""
    span = layers[first:end]
    tied = [c.tied_bytes for c in span if c.tied_bytes]
    return sum(c.param_bytes for c in span) - sum(tied) + max(tied, default=0)


def stage_memory_parts(layers: list[LayerCost], first: int, end: int, in_flight: int,
                       recompute: list[int], selective: list[int] = ()) -> dict[str, int]:
    """A stage's modelled peak by part: parameters with their gradients and optimizer states,
    the activations its ``in_flight`` micro-batches keep (a recomputed layer its input, a
    selective one its matmuls' outputs), the largest recomputed layer rebuilt in backward, and
    the largest transient (a selective layer's rebuild among them)."""
    span = with_selective(layers[first:end], [i - first for i in selective])
    whole = {i - first for i in recompute}
    kept = sum(c.input_bytes if k in whole else c.activation_bytes for k, c in enumerate(span))
    return {"params": stage_param_bytes(span, 0, len(span)),
            "activations": in_flight * kept,
            "rebuilt": max((span[k].activation_bytes for k in whole), default=0),
            "transient": max((c.transient_bytes for c in span), default=0)}


def stage_memory(layers: list[LayerCost], first: int, end: int, in_flight: int,
                 recompute: list[int], selective: list[int] = ()) -> int:
    return sum(stage_memory_parts(layers, first, end, in_flight, recompute, selective).values())


def with_selective(layers: list[LayerCost], selective) -> list[LayerCost]:
    """``layers`` with those at the indices ``selective`` recomputed selectively (one without a
    selective mode costed as it is: it keeps at most what it keeps unrecomputed)."""
    chosen = set(selective)
    return [c.selectively if i in chosen and c.selective_bytes is not None else c
            for i, c in enumerate(layers)]


def choose_selective(layers: list[LayerCost], first: int, end: int, in_flight: int,
                     budget: int) -> tuple[list[int], list[int]] | None:
    """Recompute for a stage: (whole layers, selective layers), none where it fits as it is.
    Selective recompute costs no matrix FLOPs, so it comes first: the fewest layers with a
    selective mode, largest saving first, that make the stage fit; where all of them are not
    enough, the fewest whole layers on top (``choose_recompute``, the rest selective: a whole
    layer rebuilds its full activation beside its own transient, not its selective one's).
    None if nothing fits."""
    # stage_memory with ``chosen`` selective, kept up as each joins
    params = stage_param_bytes(layers, first, end)
    kept = in_flight * sum(layers[i].activation_bytes for i in range(first, end))
    transient = max(layers[i].transient_bytes for i in range(first, end))
    if params + kept + transient <= budget:
        return [], []
    eligible = sorted((i for i in range(first, end) if layers[i].selective_bytes is not None),
                      key=lambda i: (-(layers[i].activation_bytes - layers[i].selective_bytes), i))
    chosen: list[int] = []
    for i in eligible:
        chosen.append(i)
        kept -= in_flight * (layers[i].activation_bytes - layers[i].selective_bytes)
        transient = max(transient, layers[i].selectively.transient_bytes)
        if params + kept + transient <= budget:
            return [], sorted(chosen)
    whole = choose_recompute(layers, first, end, in_flight, budget, eligible)
    if whole is None:
        return None
    return whole, sorted(i for i in eligible if i not in whole)


def predicted_stage_peak(work: list[LayerWork], recompute: list[int], size: CostTerms,
                         in_flight: int, bytes_per_param: float,
                         selective: list[int] = ()) -> dict[str, int]:
    """The analytic peak of one stage holding the layers ``work`` (recomputing those at the
    indices ``recompute`` whole, at ``selective`` selectively) with ``in_flight``
    micro-batches of ``size`` kept: by part (``stage_memory_parts``) and in total
    (``predicted_peak_bytes``), what a run's ``max_memory_allocated`` is checked against."""
    layers = analytic_layer_costs(work, time_size=size, memory_size=size, flops_per_s=1.0,
                                  bytes_per_param=bytes_per_param)
    parts = stage_memory_parts(layers, 0, len(layers), in_flight, recompute, selective)
    return {**parts, "predicted_peak_bytes": sum(parts.values())}


def stage_time(layers: list[LayerCost], first: int, end: int, recompute: list[int],
               machine: Machine, last: bool) -> float:
    compute = sum(layers[i].forward_s + layers[i].backward_s for i in range(first, end))
    send = 0.0 if last else layers[end - 1].output_bytes / machine.link_bytes_per_s
    return compute + sum(layers[i].forward_s for i in recompute) + send


def make_stage(layers: list[LayerCost], first: int, end: int, index: int, stages: int,
               machine: Machine) -> Stage | None:
    """Stage ``index`` of ``stages`` over [first, end) with its recompute; None if it cannot fit."""
    in_flight = stages - index
    selective: list[int] = []
    if machine.full_recompute:
        recompute = [i for i in range(first, end) if layers[i].has_backward]
        if stage_memory(layers, first, end, in_flight, recompute) > machine.memory_budget:
            return None
    else:
        found = choose_selective(layers, first, end, in_flight, machine.memory_budget)
        if found is None:
            return None
        recompute, selective = found
    return Stage(first, end, recompute,
                 stage_time(layers, first, end, recompute, machine, index == stages - 1),
                 stage_memory(layers, first, end, in_flight, recompute, selective), selective)


def evaluate(layers: list[LayerCost], bounds: list[int], machine: Machine) -> Partition | None:
    """A given partition (e.g. DeepSpeed's) costed with its recompute; None if a stage cannot
    fit."""
    stages = []
    for s, (first, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        stage = make_stage(layers, first, end, s, len(bounds) - 1, machine)
        if stage is None:
            return None
        stages.append(stage)
    return Partition(list(bounds), stages)


def largest_micro_batch_scale(layers: list[LayerCost], bounds: list[int], machine: Machine,
                              steps: int = 20) -> float:
    """How many times the profiled micro-batch a micro-batch may hold (its activations, input
    checkpoints, sends and transients grow with it; parameters do not) for the partition
    ``bounds`` still to fit ``machine``, recomputing what it must: the memory bound on the
    packer's caps. 0 when the parameters alone do not fit."""
    def fits(scale: float) -> bool:
        scaled = [replace(c, activation_bytes=math.ceil(c.activation_bytes * scale),
                          input_bytes=math.ceil(c.input_bytes * scale),
                          output_bytes=math.ceil(c.output_bytes * scale),
                          peak_bytes=math.ceil(c.peak_bytes * scale)) for c in layers]
        return evaluate(scaled, bounds, machine) is not None

    return _largest_scale(fits, steps)


def largest_micro_batch(work: list[LayerWork], shape: CostTerms, machine: Machine,
                        bytes_per_param: float, stages: int = 1, steps: int = 20,
                        whole_recompute: bool = True) -> CostTerms:
    """The largest micro-batch of ``shape`` (e.g. a mean sample's tiles and tokens) that some
    partition of the analytic model ``work`` into ``stages`` holds in ``machine``'s memory,
    recomputing what it must (with ``whole_recompute`` off, selectively only: no layer's
    matrix FLOPs run twice): the memory bound on the packer's caps before any profile. Each
    candidate is costed at its own size (the loss's chunk does not grow past its rows). Zero
    when the parameters alone do not fit."""
    def fits(scale: float) -> bool:
        # every token supervised: the most the LM head can cost (a shape knows no labels)
        size = CostTerms(shape.tiles * scale, shape.tokens * scale,
                         supervised=shape.tokens * scale)
        layers = analytic_layer_costs(work, time_size=size, memory_size=size, flops_per_s=1.0,
                                      bytes_per_param=bytes_per_param)
        try:
            found = search_partition(layers, stages, machine)
        except PartitionError:
            return False
        return whole_recompute or not found.recompute

    scale = _largest_scale(fits, steps)
    return CostTerms(shape.tiles * scale, shape.tokens * scale, supervised=shape.tokens * scale)


def _largest_scale(fits, steps: int) -> float:
    """The largest scale ``fits`` holds for (monotone), by doubling then bisection to within
    2^-``steps`` of it (the default's 1e-6: a fraction of a token at any cap); 0 if not even an
    empty micro-batch fits, inf if any does."""
    if not fits(0.0):
        return 0.0
    high = 1.0
    while fits(high):
        if high > 2.0 ** 40:  # activations that cost nothing: no bound from memory
            return float("inf")
        high *= 2
    low = high / 2 if high > 1 else 0.0
    for _ in range(steps):
        mid = (low + high) / 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low


def search_partition(layers: list[LayerCost], stages: int, machine: Machine) -> Partition:
    """The exact min-max partition into ``stages`` non-empty contiguous stages that fit memory."""
    n = len(layers)
    _check_stage_count(n, stages)
    # a stage's compute, a lower bound on its time that grows with every layer it takes
    compute = list(itertools.accumulate((c.forward_s + c.backward_s for c in layers),
                                        initial=0.0))

    @lru_cache(maxsize=None)
    def best(s: int, first: int) -> tuple[float, tuple[int, ...]]:
        """Min over partitions of layers [first, n) into stages s..stages-1 of the max time."""
        if s == stages - 1:
            stage = make_stage(layers, first, n, s, stages, machine)
            return (stage.time_s, (first, n)) if stage else (float("inf"), ())
        result = (float("inf"), ())
        for end in range(first + 1, n - (stages - 1 - s) + 1):
            if compute[end] - compute[first] >= result[0]:
                break  # stage s's compute alone is no better: nor a longer stage's
            stage = make_stage(layers, first, end, s, stages, machine)
            if stage is None:
                break  # a longer stage s holds at least as much: it cannot fit either
            rest, bounds = best(s + 1, end)
            cost = max(stage.time_s, rest)
            if cost < result[0]:
                result = (cost, (first,) + bounds)
        return result

    cost, bounds = best(0, 0)
    if cost == float("inf"):
        raise PartitionError(_why_infeasible(layers, stages, machine))
    return evaluate(layers, list(bounds), machine)


def omnibal_candidates(layers: list[LayerCost], stages: int, machine: Machine,
                       radius: int = 2) -> list[Partition]:
    """OmniBal's search: the greedy anchor (equal shares of compute), every partition whose
    boundaries lie within ``radius`` layers of it, ranked by stage-time variance, then by the
    bytes crossing stage boundaries. Infeasible candidates are dropped."""
    n = len(layers)
    _check_stage_count(n, stages)
    anchor = greedy_anchor([lay.forward_s + lay.backward_s for lay in layers], stages)
    ranges = [range(max(1, b - radius), min(n - 1, b + radius) + 1) for b in anchor[1:-1]]
    seen, found = set(), []
    for cuts in itertools.product(*ranges):
        if list(cuts) != sorted(set(cuts)) or cuts in seen:
            continue
        seen.add(cuts)
        candidate = evaluate(layers, [0, *cuts, n], machine)
        if candidate:
            found.append(candidate)

    def rank(p: Partition) -> tuple[float, int]:
        times = [s.time_s for s in p.stages]
        mean = sum(times) / len(times)
        return (sum((t - mean) ** 2 for t in times) / len(times),
                sum(layers[b - 1].output_bytes for b in p.bounds[1:-1]))

    return sorted(found, key=rank)


def greedy_anchor(costs: list[float], stages: int) -> list[int]:
    """Boundaries where the cumulative cost crosses each 1/stages share (every stage non-empty)."""
    n, total = len(costs), sum(costs)
    bounds, running = [0], 0.0
    for i, c in enumerate(costs):
        running += c
        s = len(bounds)
        if s < stages and running >= total * s / stages and n - (i + 1) >= stages - s:
            bounds.append(i + 1)
    while len(bounds) < stages:  # tiny layer counts: take one layer per missing stage
        bounds.append(bounds[-1] + 1)
    return bounds + [n]


def _check_stage_count(n: int, stages: int) -> None:
    if stages < 1:
        raise PartitionError(f"need at least one pipeline stage, got {stages}")
    if stages > n:
        raise PartitionError(f"{stages} pipeline stages for {n} layers would leave a stage "
                             "empty; use at most as many stages as layers")


def _why_infeasible(layers: list[LayerCost], stages: int, machine: Machine) -> str:
    """The stage that cannot fit and the bytes it needs with every layer recomputed: one stage
    holds the whole model; of more, the first holds at least its most demanding layer, and
    where that layer alone fits, the fullest stage of the partition whose fullest stage needs
    least (stages hold consecutive layers, stage s its share of PP − s micro-batches)."""
    def need(first: int, end: int, stage: int) -> int:
        return stage_memory(layers, first, end, stages - stage, list(range(first, end)))

    budget = f"above the {machine.memory_budget / 2**30:.2f} GiB a stage has"
    if stages == 1:
        return (f"no partition into 1 stage(s) fits: stage 0 (every layer) needs "
                f"{need(0, len(layers), 0) / 2**30:.2f} GiB even with full recompute, {budget}")
    worst = max(range(len(layers)), key=lambda i: layers[i].param_bytes + stages *
                layers[i].input_bytes)
    alone = need(worst, worst + 1, 0)
    if alone > machine.memory_budget:
        return (f"no partition into {stages} stage(s) fits: stage 0 (layer {layers[worst].name} "
                f"alone) needs {alone / 2**30:.2f} GiB even with full recompute, {budget}")
    most, (stage, first, end) = _least_fullest(len(layers), stages, need)
    return (f"no partition into {stages} stage(s) fits: the best leaves stage {stage} (layers "
            f"{layers[first].name} to {layers[end - 1].name}) needing {most / 2**30:.2f} GiB "
            f"even with full recompute, {budget}")


def _least_fullest(n: int, stages: int, need) -> tuple[int, tuple[int, int, int]]:
    """Over the partitions of ``n`` layers into ``stages`` non-empty stages, the least
    fullest-stage ``need(first, end, stage)``, and that stage: a dynamic programme over where
    each stage ends."""
    best = {0: (0, (0, 0, 0))}  # layers placed -> (fullest so far, that stage)
    for stage in range(stages):
        ends = range(stage + 1, n - stages + stage + 2) if stage < stages - 1 else [n]
        step = {}
        for end in ends:
            for first, (full, where) in best.items():
                if first < end:
                    here = need(first, end, stage)
                    found = (full, where) if full >= here else (here, (stage, first, end))
                    if end not in step or found[0] < step[end][0]:
                        step[end] = found
        best = step
    return best[n]


def deepspeed_bounds(layers: list[LayerCost], stages: int, method: str) -> list[int]:
    """What DeepSpeed's ``partition_method`` would choose (its own functions)."""
    from deepspeed.runtime.utils import partition_balanced, partition_uniform

    if method == "parameters":
        return [int(b) for b in partition_balanced([lay.param_bytes for lay in layers], stages)]
    if method == "uniform":
        return list(partition_uniform(len(layers), stages))
    raise ValueError(f"unknown partition method {method!r}")
