"""Cluster-scale simulation of training on a plan: what balance saves before any GPU hour is spent.

For every step, each data-parallel replica runs its micro-batches through a 1F1B pipeline of P
stages. A stage's forward time for a micro-batch is its layers' FLOPs for that micro-batch's
(Σtiles, Σtokens, Σseq_len²) over the GPU's sustained FLOP rate, plus sending its output
activation; backward is twice the forward plus the forward of its recomputed layers. ViT stages
and LLM stages therefore differ per micro-batch, exactly as on the cluster. The step takes the
slowest replica; the epoch is the sum of its steps. The sizes are what the trainer executes
(``vlmshard.packing.metrics.executed_sizes``): in ``padded`` compute mode Qv tiles and Qt
tokens with the real samples' squares, so step times, activation memory and the partition
search see the caps.

- bubble fraction: the share of stage-time the pipeline leaves idle, within each replica;
- waiting fraction: the share of replica-time spent waiting for the slowest replica of the step.

The same 1F1B recurrence, fed with measured per-layer times from ``vlmshard train profile``,
predicts a real run's step times (``vlmshard.simulate.replay``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from vlmshard.errors import ConfigError, InputError
from vlmshard.hardware import GPU
from vlmshard.model_sizes import CostTerms, LayerWork, forward_flops, layer_training_flops
from vlmshard.partition import Machine, Partition, analytic_layer_costs, deepspeed_bounds

log = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------------------
# The 1F1B pipeline


def one_f_one_b(stages: int, micro_batches: int) -> list[tuple[str, int, int]]:
    """Every (kind, stage, micro-batch) of one 1F1B step, in an order where each operation comes
    after the one before it on its stage and after the one it needs from a neighbour stage."""
    programs = []
    for s in range(stages):
        warmup = min(stages - s - 1, micro_batches)
        ops = [("F", m) for m in range(warmup)]
        for m in range(micro_batches - warmup):
            ops += [("F", warmup + m), ("B", m)]
        ops += [("B", m) for m in range(micro_batches - warmup, micro_batches)]
        programs.append(ops)
    done, order, cursor = set(), [], [0] * stages
    while len(order) < 2 * stages * micro_batches:
        progressed = False
        for s in range(stages):
            if cursor[s] == len(programs[s]):
                continue
            kind, m = programs[s][cursor[s]]
            need = (("F", s - 1, m) if s > 0 else None) if kind == "F" else \
                (("B", s + 1, m) if s < stages - 1 else ("F", s, m))
            if need is None or need in done:
                done.add((kind, s, m))
                order.append((kind, s, m))
                cursor[s] += 1
                progressed = True
        assert progressed, "the 1F1B programs deadlocked"
    return order


def pipeline_times(forward: np.ndarray, backward: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Makespan [B] and busy time per stage [B, P] of B independent pipelines, given the forward
    and backward time [B, M, P] of each micro-batch on each stage (sends included)."""
    n, micro, stages = forward.shape
    free = np.zeros((n, stages))
    finish = {}
    for kind, s, m in one_f_one_b(stages, micro):
        if kind == "F":
            ready = finish[("F", s - 1, m)] if s > 0 else 0.0
            duration = forward[:, m, s]
        else:
            ready = finish[("B", s + 1, m)] if s < stages - 1 else finish[("F", s, m)]
            duration = backward[:, m, s]
        end = np.maximum(free[:, s], ready) + duration
        finish[(kind, s, m)] = free[:, s] = end
    return free.max(axis=1), forward.sum(axis=1) + backward.sum(axis=1)


# ---------------------------------------------------------------------------------------------
# Stage times from layer work

# The sizes a layer's time is linear in (``model_sizes.CostTerms``'s, the LLM's sliding-window
# attention charged as full): a logged micro-batch has them all (``logged_columns``); a plan
# the tiles, tokens, squares, supervised tokens and a ViT's Σ P² (``planned_columns``)
COLUMNS = ("tiles", "tokens", "squares", "vit_squares", "vit_windows", "supervised")


def logged_columns(sizes: dict) -> list[float]:
    """A micro-batch's sizes as the trainer logs them (``train_log.micro_batch_size``) in
    ``COLUMNS``; those a model has none of are 0. A log from before the supervised count
    (``supervised`` absent) gives its tokens there: the most the LM head can have run on."""
    return [float(sizes.get(k, sizes["tokens"] if k == "supervised" else 0.0)) for k in COLUMNS]


def planned_columns(sizes: np.ndarray) -> np.ndarray:
    """A plan's sizes or rates [..., 3, 4 or 5] (tiles, tokens, Σseq_len², supervised tokens,
    and Σ P² over ViT units of P patches: ``packing.metrics.micro_batch_sizes`` with its units'
    tiles² in patches², ``in_patches``) in ``COLUMNS``, a column absent 0. A windowed ViT's
    windows are not counted (no preset has one)."""
    def column(i: int) -> np.ndarray:
        return sizes[..., i:i + 1] if sizes.shape[-1] > i else np.zeros((*sizes.shape[:-1], 1))

    return np.concatenate([sizes[..., :3], column(4), np.zeros((*sizes.shape[:-1], 1)),
                           column(3)], axis=-1)


def in_patches(sizes: np.ndarray, patches_per_tile: int) -> np.ndarray:
    """A plan's micro-batch sizes [..., 5] with their fifth column, Σ tiles² over ViT units,
    in patches² (``planned_columns``'s)."""
    out = np.array(sizes, dtype=np.float64)
    out[..., 4] *= patches_per_tile ** 2
    return out


def plan_sizes(sizes: np.ndarray) -> np.ndarray:
    """A plan's micro-batch sizes [..., 3, 4 or 5] in ``COLUMNS``; sizes without the supervised
    count (tiles, tokens, Σseq_len² only) take their tokens there, the most there can be."""
    sizes = np.asarray(sizes, dtype=float)
    if sizes.shape[-1] == 3:
        sizes = np.concatenate([sizes, sizes[..., 1:2]], axis=-1)
    return planned_columns(sizes)


def plan_terms(sizes: np.ndarray) -> CostTerms:
    """A plan's micro-batch sizes [3, 4 or 5] (``plan_sizes``) as ``CostTerms``."""
    return CostTerms(**dict(zip(COLUMNS, plan_sizes(sizes))))


@dataclass(frozen=True)
class LayerRates:
    """Per layer, seconds per unit of each of ``COLUMNS`` forward and backward, and the output
    activation's bytes per unit: analytic (``from_work``) or measured (``from_profile``)."""

    forward: np.ndarray  # [layers, COLUMNS]
    backward: np.ndarray  # [layers, COLUMNS]
    output_bytes: np.ndarray  # [layers, COLUMNS]

    @classmethod
    def from_work(cls, work: list[LayerWork], flops_per_s: float | np.ndarray,
                  modes: list[str] | None = None) -> "LayerRates":
        """FLOPs at a sustained rate, one for all layers or one per layer; backward is what
        each layer's mode runs (``vlmshard.recipe``; by default every layer trains: twice the
        forward), the LM head's all in its forward (``model_sizes.forward_flops``)."""
        rate = np.reshape(flops_per_s, (-1, 1))
        modes = modes or ["train"] * len(work)
        forward = np.array([_vector(forward_flops(w, mode)) for w, mode in zip(work, modes)]
                           ) / rate
        executed = np.array([_vector(layer_training_flops(w, mode)) for w, mode
                             in zip(work, modes)]) / rate
        return cls(forward, executed - forward,
                   np.array([_vector(w.output_bytes) for w in work]))

    @classmethod
    def sustained(cls, work: list[LayerWork], profile: dict,
                  modes: list[str] | None = None) -> "LayerRates":
        """FLOPs at the rate the profile measured for each layer's kind
        (``sustained_flops_per_s``), each layer's backward as its mode runs it."""
        if any("kind" not in layer for layer in profile["layers"]):
            raise InputError("the profile names no layer kinds (a profile of an older "
                             "vlmshard): run vlmshard train profile again")
        rates = sustained_flops_per_s(profile, work)
        # a kind with no FLOPs counted takes no time at any rate
        return cls.from_work(work, np.array([rates.get(layer["kind"], np.inf)
                                             for layer in profile["layers"]]), modes)

    @classmethod
    def from_profile(cls, profile: dict, cost_model: dict,
                     work: list[LayerWork] | None = None) -> "LayerRates":
        """``vlmshard train profile``'s mean layer times, scaled per micro-batch: LLM-side layers
        by the fitted ``a_t·tokens + b·squares``, ViT-side layers by tiles, or given the
        layers' analytic ``work`` by their FLOPs at the micro-batch over their FLOPs at the
        profiled mean, so that a Qwen ViT block's attention across images follows each
        micro-batch's squared patch counts (where the profile logged them)."""
        mean = np.mean([logged_columns(b) for b in profile["micro_batches"]], axis=0)
        llm = planned_columns(np.array([0.0, cost_model["a_t"], cost_model["b"],
                                        cost_model.get("a_s", 0.0)]))
        llm_unit = llm / max(llm @ mean, 1e-30)
        vit_unit = planned_columns(np.array([1.0 / max(mean[0], 1e-30), 0.0, 0.0, 0.0]))
        per_token = planned_columns(np.array([0.0, 1.0 / max(mean[1], 1e-30), 0.0, 0.0]))
        layers = profile["layers"]

        def vision_unit(i: int) -> np.ndarray:
            if work is None or not mean[3:5].any():  # no ViT attention sizes logged
                return vit_unit
            shape = _vector(work[i].flops)
            at_mean = shape @ mean
            return shape / at_mean if at_mean > 0 else vit_unit

        unit = [vision_unit(i) if i <= _last_vision_layer(profile) else llm_unit
                for i in range(len(layers))]
        forward = np.array([u * lay["forward_s"] for u, lay in zip(unit, layers)])
        backward = np.array([u * lay["backward_s"] for u, lay in zip(unit, layers)])
        projector = _last_vision_layer(profile)  # its output is image features, per tile
        output = np.array([(vit_unit if i <= projector else per_token) * lay["output_bytes"]
                           for i, lay in enumerate(layers)])
        return cls(forward, backward, output)


def sustained_flops_per_s(profile: dict, work: list[LayerWork]) -> dict[str, float]:
    """Per layer kind, the FLOP rate its layers sustained in ``vlmshard train profile``
    (``profile``, its layers in the order of ``work``): their analytic training FLOPs (forward
    and backward, three forwards) at the profiled micro-batches' mean size over their measured
    forward + backward seconds. Kinds with no FLOPs counted (the token embedding, the final
    norm) have none. Divided by the device's peak: the sustained share of it per kind."""
    mean = np.mean([logged_columns(m) for m in profile["micro_batches"]], axis=0)
    flops: dict[str, float] = {}
    seconds: dict[str, float] = {}
    for layer, w in zip(profile["layers"], work, strict=True):
        kind = layer["kind"]
        flops[kind] = flops.get(kind, 0.0) + float(_vector(layer_training_flops(w, "train"))
                                                           @ mean)
        seconds[kind] = seconds.get(kind, 0.0) + layer["forward_s"] + layer["backward_s"]
    return {kind: flops[kind] / seconds[kind] for kind in flops
            if flops[kind] > 0 and seconds[kind] > 0}


def _last_vision_layer(profile: dict) -> int:
    """The projector: the last layer whose work scales with tiles."""
    return [lay["name"] for lay in profile["layers"]].index("projector")


@dataclass(frozen=True)
class StageModel:
    """Per stage, seconds per unit of each of ``COLUMNS``: compute forward and backward, and
    the sends between stages (forward: the stage's output; backward: its input's gradient). A
    micro-batch's compute follows its sizes; its sends follow the shapes the stages exchange,
    the caps (a pipeline sends static shapes)."""

    forward: np.ndarray  # [P, COLUMNS] compute
    backward: np.ndarray  # [P, COLUMNS] compute, recomputed forwards included
    send_forward: np.ndarray | None = None  # [P, COLUMNS] output sent to the next stage
    send_backward: np.ndarray | None = None  # [P, COLUMNS] gradient sent back to the stage before

    @classmethod
    def build(cls, rates: LayerRates, partition: Partition, link_bytes_per_s: float,
              input_grads: list[bool] | None = None) -> "StageModel":
        """Stage sums of layer rates; a stage sends its output forward and its input's gradient
        back over the link (where its first layer's input needs one: ``input_grads``, per
        layer; by default all do); recomputed layers run their forward again in backward."""
        forward, backward, send_forward, send_backward = [], [], [], []
        last = len(partition.stages) - 1
        for index, stage in enumerate(partition.stages):
            layers = slice(stage.first, stage.end)
            forward.append(rates.forward[layers].sum(axis=0))
            backward.append(rates.backward[layers].sum(axis=0)
                            + rates.forward[stage.recompute].sum(axis=0))
            send_forward.append(rates.output_bytes[stage.end - 1] / link_bytes_per_s
                                if index < last else np.zeros(rates.forward.shape[1]))
            grad_in = index and (input_grads is None or input_grads[stage.first])
            send_backward.append(rates.output_bytes[stage.first - 1] / link_bytes_per_s
                                 if grad_in else np.zeros(rates.forward.shape[1]))
        return cls(*(np.array(x) for x in (forward, backward, send_forward, send_backward)))

    def times(self, sizes: np.ndarray,
              wire: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Forward and backward seconds [..., P] of micro-batches with sizes [..., COLUMNS] whose
        stages exchange tensors of ``wire`` sizes (the caps; by default the sizes)."""
        forward, backward = sizes @ self.forward.T, sizes @ self.backward.T
        if self.send_forward is not None:
            wire = sizes if wire is None else np.broadcast_to(wire, sizes.shape)
            forward = forward + wire @ self.send_forward.T
            backward = backward + wire @ self.send_backward.T
        return forward, backward


def _vector(size: CostTerms) -> np.ndarray:
    size = size.windows_as_full()  # the simulator's sizes know Σseq_len² only
    return np.array([getattr(size, k) for k in COLUMNS], dtype=np.float64)


# ---------------------------------------------------------------------------------------------
# A plan on a cluster


def share(part: np.ndarray, whole: np.ndarray) -> np.ndarray:
    """1 − part / whole, and 0 where whole is 0 (nothing ran, nothing idled)."""
    safe = np.where(whole > 0, whole, 1.0)
    return np.where(whole > 0, 1 - part / safe, 0.0)


@dataclass(frozen=True)
class PipelineTimes:
    """Per step, each replica's pipeline makespan and each of its stages' busy time (forward +
    backward), in one unit (seconds, or FLOPs for an analytic replay)."""

    makespan: np.ndarray  # [steps, D]
    busy: np.ndarray  # [steps, D, P]

    def stage_bubble_per_step(self) -> np.ndarray:
        """[steps, P] each stage's idle share of its replicas' pipelines."""
        return share(self.busy.sum(axis=1), self.makespan.sum(axis=1)[:, None])

    def waiting_per_step(self) -> np.ndarray:
        """[steps] the replicas' share of the step spent waiting for the slowest one."""
        dp = self.makespan.shape[1]
        return share(self.makespan.sum(axis=1), dp * self.makespan.max(axis=1))

    def stage_bubble(self) -> np.ndarray:
        """[P] over the run: each stage's idle share (the mean is ``simulate``'s bubble)."""
        return share(self.busy.sum(axis=(0, 1)), np.full(self.busy.shape[2],
                                                          self.makespan.sum()))

    def waiting(self) -> float:
        """Over the run, as ``simulate``'s ``waiting_fraction``."""
        dp = self.makespan.shape[1]
        return float(share(self.makespan.sum(), dp * self.makespan.max(axis=1).sum()))




@dataclass
class Simulation:
    """One epoch of a plan on P × D GPUs."""

    steps: int
    seconds: float
    gpu_days: float
    bubble_fraction: float
    waiting_fraction: float
    step_seconds: np.ndarray  # [steps]

    def summary(self) -> dict:
        return {"steps": self.steps, "seconds": self.seconds, "gpu_days": self.gpu_days,
                "bubble_fraction": self.bubble_fraction,
                "waiting_fraction": self.waiting_fraction}


def replica_micro_batches(sizes: np.ndarray, ranks: int, micro: int, dp: int,
                          per_step: int | None = None) -> np.ndarray:
    """Micro-batch sizes [steps, dp, M, C] of each replica's steps, from the plan's [..., C].
    The plan's step-major micro-batches [steps, ranks, micro] go to replicas by virtual rank
    (replica d takes ranks d·V/D … (d+1)·V/D − 1); ``per_step`` regroups each replica's stream
    into steps of M."""
    if ranks % dp:
        raise ConfigError(f"dp={dp} does not divide the plan's {ranks} virtual ranks")
    steps, width = len(sizes) // (ranks * micro), sizes.shape[-1]
    streams = sizes[:steps * ranks * micro].reshape(steps, dp, ranks // dp * micro, width)
    streams = streams.transpose(1, 0, 2, 3).reshape(dp, -1, width)  # each replica's stream
    m = per_step or ranks // dp * micro
    whole = streams.shape[1] // m
    if whole == 0:
        raise ConfigError(f"--micro-batches {m} is more than a replica's "
                          f"{streams.shape[1]} micro-batches in the whole plan")
    if whole * m < streams.shape[1]:
        log.warning("%d micro-batches per replica do not fill a last step of %d; left out",
                    streams.shape[1] - whole * m, m)
    return streams[:, :whole * m].reshape(dp, whole, m, width).transpose(1, 0, 2, 3)


def simulate(batches: np.ndarray, model: StageModel,
             wire: np.ndarray | None = None) -> Simulation:
    """One epoch of ``batches`` [steps, D, M, 3, 4 or 5] (``planned_columns``) through the stage
    model, the stages exchanging ``wire``-sized tensors (the caps)."""
    steps, dp, micro, width = batches.shape
    forward, backward = model.times(plan_sizes(batches.reshape(steps * dp, micro, width)),
                                    None if wire is None else planned_columns(wire))
    makespan, busy = pipeline_times(forward, backward)
    times = PipelineTimes(makespan.reshape(steps, dp), busy.reshape(steps, dp, -1))
    step = times.makespan.max(axis=1)
    total = float(step.sum())
    return Simulation(
        steps=steps, seconds=total, gpu_days=total * times.busy.shape[-1] * dp / 86400,
        bubble_fraction=float(times.stage_bubble().mean()) if total else 0.0,
        waiting_fraction=times.waiting(), step_seconds=step)


def search_for(work: list[LayerWork], sizes: np.ndarray, stages: int, gpu: GPU, *,
               flops_per_s: float, bytes_per_param: float, full_recompute: bool = False,
               method: str = "search", modes: list[str] | None = None,
               frozen_bytes_per_param: float = 0.0) -> Partition:
    """The stage partition for these micro-batch sizes: the exact search (``method="search"``)
    or DeepSpeed's ``parameters``/``uniform``, with adaptive (or full) recompute; each layer
    costed as ``modes`` runs it (``analytic_layer_costs``)."""
    from vlmshard.partition import PartitionError, evaluate, search_partition

    mean, peak = sizes.mean(axis=0), sizes.max(axis=0)
    layers = analytic_layer_costs(work, time_size=plan_terms(mean), memory_size=plan_terms(peak),
                                  flops_per_s=flops_per_s, bytes_per_param=bytes_per_param,
                                  modes=modes, frozen_bytes_per_param=frozen_bytes_per_param)
    machine = Machine.for_device(gpu.memory_bytes, gpu.link_bytes_per_s, full_recompute)
    if method == "search":
        return search_partition(layers, stages, machine)
    bounds = deepspeed_bounds(layers, stages, method)
    partition = evaluate(layers, bounds, machine)
    if partition is None:
        raise PartitionError(f"DeepSpeed's '{method}' partition {bounds} does not fit "
                             f"{gpu.name} memory{' with full recompute' if full_recompute else ''}")
    return partition
