"""Profile the model layer by layer on real micro-batches, calibrate the packer's cost model, and
choose the pipeline partition and per-stage recompute.

Each pipeline layer runs alone on the activations the previous layer produced, so its forward and
backward times, the bytes autograd saves for its backward (its activation memory), its input and
output bytes, its parameter bytes and the most it holds at once while it runs (the allocator's
peak on a GPU; on CPU torch's memory tracker, in one more untimed run) are its own. Beside the
measured activation bytes, profile.json holds the analytic model's (``model_sizes``) for the
same micro-batches: the figure the default partition trusts, checked against the measurement.
Times are the median of ``--repeats`` runs after ``--warmup`` untimed ones, timed with CUDA
events on a GPU. Parameters are costed at the bytes the trainer
holds per parameter in the run's precision (``model_sizes.bytes_per_param``).

Only one layer of each kind is built (``ModelLayers.build_all(one_per_kind=True)``, from the
meta device): it runs in the place of every layer of its kind, on that layer's real input, so a
model far larger than the device profiles layer by layer in the memory of a few layers.
``--memory-budget`` is the device's memory; ``Machine.for_device`` takes the CUDA context, NCCL
buffers and fragmentation off it, as the simulator does.

The calibrated cost model fits, over the profiled micro-batches, the ViT layers' time to
``a_v·Σtiles`` and the LLM layers' time to ``a_t·Σtokens + b·Σseq_len²`` (non-negative least
squares), the same three coefficients ``vlmshard pack --cost-model`` reads
(``packing.cost.fit_coefficients``, which also refits a model from a training run's log).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import weakref
from dataclasses import asdict, dataclass

import numpy as np
import torch

from vlmshard.compat import check_torch, check_transformers
from vlmshard.errors import ConfigError, InputError
from vlmshard.model_sizes import (
    CHECKPOINT_STATE_BYTES,
    CostTerms,
    bytes_per_param,
    kept_bytes,
    held_transient,
    weight_bytes_per_param,
)
from vlmshard.packing.cost import fit_coefficients
from vlmshard.partition import (
    LayerCost,
    Machine,
    Partition,
    PartitionError,
    deepspeed_bounds,
    evaluate,
    largest_micro_batch_scale,
    omnibal_candidates,
    search_partition,
)
from vlmshard.stage import Result

from .attention import choose_backend
from .clock import Mark
from .config import ProfileConfig
from .default_partition import less_zero3_fixed
from .hf_model import ModelLayers, model_layers
from .kernels import Kernels
from .launcher import model_folder
from .micro import HostMeta, LayerOutput, Micro
from .recompute import run_layer
from .train_log import micro_batch_size
from .trainer import cpu_threads_per_rank

log = logging.getLogger(__name__)


@dataclass
class ProfileResult(Result):
    """The partitions compared (partition.json's content) and the folder written."""

    partitions: dict
    out: str

    def summary(self) -> str:
        chosen = self.partitions["chosen"]
        return (f"chosen partition {chosen['name']}: bounds {chosen['bounds']}, max stage "
                f"{chosen['max_stage_s']:.4f} s -> {self.out}/profile.json, cost_model.json, "
                "partition.json")

    def text(self) -> str:
        measured = {p["name"]: p["measured_step_s"] for p in self.partitions.get("validated", [])}
        lines = [f"{'partition':<11} {'max stage s':>11} {'measured s':>10}  stage times (s) / "
                 "recomputed layers"]
        rows = [(name, self.partitions[name]) for name in ("parameters", "uniform", "search")]
        for name, p in rows + [(p["name"], p) for p in self.partitions["omnibal"]]:
            if p is None:
                lines.append(f"{name:<11} {'does not fit':>11}")
                continue
            times = " ".join(f"{s['time_s']:.4f}/{len(s['recompute'])}" for s in p["stages"])
            real = f"{measured[name]:.4f}" if name in measured else "-"
            lines.append(f"{name:<11} {p['max_stage_s']:>11.4f} {real:>10}  {times}   bounds "
                         f"{p['bounds']}")
        return "\n".join(lines + [self.summary()])

    def to_json(self) -> dict:
        return self.partitions


def run_profile(cfg: ProfileConfig) -> ProfileResult:
    """Profile, calibrate, search (and validate); writes profile.json, cost_model.json and
    partition.json, whose ``chosen`` partition ``vlmshard train --partition`` uses."""
    from itertools import islice

    from vlmshard.config import parse_size
    from vlmshard.io import write_json_atomic
    from vlmshard.shards.layout import read_manifest
    from vlmshard.shards.loader import ShardDataset

    check_torch()
    check_transformers()
    device = cfg.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cfg.resolve_device_defaults(device.startswith("cuda"))
    if device == "cpu":  # a rank's device is its share of the cores, as in training
        torch.set_num_threads(cpu_threads_per_rank(cfg.pp * cfg.dp))
    torch.manual_seed(cfg.seed)
    folder = model_folder(cfg)
    try:
        model = model_layers(folder, choose_backend(device, cfg.dtype, cfg.attention),
                             Kernels.of(cfg), cfg.recipe)
    except ValueError as e:  # a config.json the layer maps cannot build
        raise InputError(f"{folder}: {e}") from e
    if read_manifest(cfg.shards).step_groups:
        raise ConfigError(f"{cfg.shards} were packed with --groups: profile shards packed "
                          "without it, for the same model and caps")
    batches = list(islice(ShardDataset(cfg.shards, 0, 1, pixel_dtype=cfg.dtype),
                          cfg.micro_batches))
    window = layer_kind_window(folder)
    profile = profile_layers(model, batches, device, cfg.dtype, cfg.repeats, cfg.warmup,
                             param_bytes=bytes_per_param(cfg.precision, cfg.dp,
                                                         cfg.grad_accum, cfg.zero),
                             frozen_bytes=weight_bytes_per_param(cfg.precision, cfg.dp,
                                                                 cfg.zero))
    try:
        machine = Machine.for_device(parse_size(cfg.memory_budget), cfg.link_bytes_per_s)
    except ValueError as e:  # a budget the CUDA context and buffers take whole
        raise ConfigError(f"--memory-budget {cfg.memory_budget}: {e}") from e
    machine, _ = less_zero3_fixed(cfg, model, machine, f"--memory-budget {cfg.memory_budget}")
    try:
        partitions = compare_partitions(profile.layers, cfg.pp, machine)
    except PartitionError as e:
        raise PartitionError(f"{e}; raise --memory-budget or use more stages") from e
    if cfg.validate_top:
        partitions["validated"] = validate_candidates(
            cfg, [partitions["search"], *partitions["omnibal"]][:cfg.validate_top])
        partitions["chosen"] = min(partitions["validated"], key=lambda p: p["measured_step_s"])
    cost = {**fit_coefficients(profile.micro_batches, window.get("window_share", 0.0)), **window,
            **memory_caps(profile, partitions["chosen"]["bounds"], machine)}
    os.makedirs(cfg.out, exist_ok=True)
    write_json_atomic(os.path.join(cfg.out, "profile.json"),
                      {**profile.to_dict(), "model": model.path, "shards": cfg.shards})
    write_json_atomic(os.path.join(cfg.out, "cost_model.json"),
                      {**cost, "unit": "seconds", "device": device,
                       "model": os.path.basename(model.path)})
    write_json_atomic(os.path.join(cfg.out, "partition.json"),
                      {**partitions, "machine": asdict(machine), "pp": cfg.pp})
    return ProfileResult(partitions, cfg.out)


@dataclass
class Profile:
    layers: list[LayerCost]  # means over the profiled micro-batches
    micro_batches: list[dict]  # per micro-batch: tiles, tokens, squares, vit_s, llm_s
    device: str
    # per layer, what the analytic model (``model_sizes``) says it keeps and holds beyond that
    # for the same micro-batches: the memory model's figures beside the measured
    # ``activation_bytes`` and ``transient_bytes``
    analytic: list[dict]
    # per layer its kind (``LayerDef.kind``): layers of a kind share shapes and cost, and the
    # simulator's replay takes one sustained FLOP rate per kind
    kinds: list[str]

    def to_dict(self) -> dict:
        return {"device": self.device,
                "layers": [{**asdict(c), "kind": kind, "transient_bytes": c.transient_bytes,
                            **{f"analytic_{k}": v for k, v in a.items()}}
                           for c, a, kind in zip(self.layers, self.analytic, self.kinds)],
                "micro_batches": self.micro_batches}


def _tensor_bytes(x) -> int:
    return sum(t.numel() * t.element_size() for t in (x if isinstance(x, tuple) else (x,))
               if torch.is_tensor(t) and t.is_floating_point())


def _outputs(out) -> list[torch.Tensor]:
    """The tensors a layer's output (or input micro-batch) holds: x, and what it carries."""
    if isinstance(out, (LayerOutput, Micro)):
        return [out.x, *out.carry.values()]
    return [out]


def _detached(out: LayerOutput | Micro, requires_grad: bool = False) -> LayerOutput:
    """The tensors of a layer output (or micro-batch) as leaves, cut from their graph."""
    def cut(t: torch.Tensor) -> torch.Tensor:
        return t.detach().requires_grad_(requires_grad and t.is_floating_point())

    return LayerOutput(cut(out.x), {k: cut(t) for k, t in out.carry.items()})


def profile_layers(model: ModelLayers, batches: list[dict], device: str = "cpu",
                   dtype: torch.dtype = torch.float32, repeats: int = 3, warmup: int = 1,
                   param_bytes: float = 16.0, frozen_bytes: float = 4.0) -> Profile:
    """Time and measure every layer on each batch (collated micro-batches from the loader), each
    on the real rows the previous layer produced, as a pipeline stage runs it, in the mode its
    recipe runs it (``ModelLayers.modes``: a frozen prefix forward only, a frozen layer after a
    trained one its input's gradient): ``warmup`` untimed runs (cuBLAS heuristics, allocator
    growth), then the median of ``repeats``. A layer's parameters cost ``param_bytes`` each
    trained, ``frozen_bytes`` frozen."""
    funcs = model.build_all(device, dtype, one_per_kind=True)
    vision = sum(1 for d in model.defs if d.output.per_tile)  # ViT layers and the projector
    work, sizes = model.analytic_work(dtype), model.sizes()
    # forward, backward, activation, input, output, peak; analytic activation and transient;
    # measured and analytic bytes kept under selective recompute beyond the input
    sums = np.zeros((len(funcs), 10))
    # (a frozen prefix keeps nothing, so it has nothing to recompute)
    selective = [w.selective_bytes is not None and mode != "forward"
                 for w, mode in zip(work, model.modes)]
    per_batch = []
    cuda = device.startswith("cuda")
    with contextlib.nullcontext() if cuda else _LiveStorages() as live:
        for batch in batches:
            micro = model.first_micro(batch, device)
            times = []
            for i, func in enumerate(funcs):
                # the pixels are data, and what a frozen prefix makes: no gradient reaches them
                x_in, carry_in = _detached(micro, requires_grad=model.input_needs_grad(i))
                layer_in = micro.with_x(x_in, carry=carry_in)
                parameters = list(func.parameters())
                out, saved, (forward, backward, peak) = _timed(func, layer_in, parameters,
                                                               warmup, repeats, cuda)
                if model.modes[i] == "forward":
                    backward = 0.0  # it has none (the lap timed an empty list)
                if cuda:  # the parameters' gradients are counted with the parameters
                    peak = max(0, peak - sum(p.numel() * p.element_size() for p in parameters
                                             if p.requires_grad))
                else:
                    peak = _host_peak_bytes(func, layer_in)
                sums[i] += (forward, backward, saved.bytes,
                            sum(map(_tensor_bytes, _outputs(layer_in))),
                            sum(map(_tensor_bytes, _outputs(out))) if i < len(funcs) - 1 else 0,
                            peak, kept_bytes(work[i], model.modes[i]).dot(
                                kept_size(model, i, micro.host)),
                            held_transient(work[i], model.modes[i],
                                            size := CostTerms(micro.num_tiles, micro.num_tokens)),
                            _selective_bytes(func, layer_in, live) if selective[i] else 0,
                            work[i].selective_bytes.dot(size) + CHECKPOINT_STATE_BYTES
                            if selective[i] else 0)
                times.append(forward + backward)
                micro = micro.with_output(_detached(out) if isinstance(out, LayerOutput)
                                          else out.detach(), model.defs[i].output)
            per_batch.append({**micro_batch_size(batch, sizes),
                              "vit_s": float(sum(times[:vision])),
                              "llm_s": float(sum(times[vision:]))})
    means = sums / max(1, len(batches))
    params = [int((param_bytes if mode == "train" else frozen_bytes) * model.parameter_count(i)
                  + param_bytes * w.adapter_params)
              for i, (mode, w) in enumerate(zip(model.modes, work))]
    costs = [LayerCost(name, float(f), float(b), int(act), int(inp), int(out), params[i],
                       int(peak), int(inp + kept) if selective[i] else None,
                       tied_bytes=params[i] if model.defs[i].tied_key else 0,
                       has_backward=model.modes[i] != "forward")
             for i, (name, (f, b, act, inp, out, peak, _, _, kept, _))
             in enumerate(zip(model.names, means))]
    return Profile(costs, per_batch, device,
                   [{"activation_bytes": int(row[6]), "transient_bytes": int(row[7]),
                     **({"selective_bytes": int(row[9])} if selective[i] else {})}
                    for i, row in enumerate(means)], [d.kind for d in model.defs])


def _timed(func, layer_in, parameters: list, warmup: int, repeats: int, cuda: bool):
    """(the output, its saved bytes, the medians of forward and backward seconds and peak bytes)
    of ``func(layer_in)`` forward and backward, ``warmup`` untimed runs then ``repeats``."""
    samples = []
    for run in range(warmup + repeats):
        saved = _SavedBytes(parameters)
        clock = _Clock(cuda)
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
            out = func(layer_in)
        clock.lap()
        outputs = [t for t in _outputs(out) if t.requires_grad]
        if outputs:
            torch.autograd.backward(outputs, [torch.ones_like(t) for t in outputs])
        clock.lap()
        for p in parameters:
            p.grad = None
        if run >= warmup:
            samples.append((*clock.read(), clock.peak_bytes))
    return out, saved, np.median(np.array(samples), axis=0)


def kept_size(model: ModelLayers, index: int, host: HostMeta) -> CostTerms:
    """The sizes of a micro-batch that layer ``index`` keeps activations for: its real tiles
    and tokens; the first layer keeps the wire's pixels and the token embedding the wire's ids,
    padded to the caps, and its image tokens' rows; the head only the supervised tokens'
    rows."""
    if index == 0:
        return CostTerms(tiles=host.qv)
    if model.input_phase(index).name == "features":
        return CostTerms(tiles=host.tiles, tokens=host.qt)
    if index == len(model.defs) - 1:
        return CostTerms(tokens=host.supervised)
    return CostTerms(tiles=host.tiles, tokens=host.tokens)


class _Clock:
    """Lap times of one layer run on ``clock.Mark``s: CUDA events on a GPU (read once at the
    end, one sync per run, the host's launch overhead not counted as the device's time), the
    host clock on CPU; and on a GPU the allocator's peak above what was allocated when the run
    began."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.peak_bytes = 0
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        self.marks = [Mark(cuda)]

    def lap(self) -> None:
        self.marks.append(Mark(self.cuda))

    def read(self) -> list[float]:
        """Seconds between consecutive laps."""
        if self.cuda:
            torch.cuda.synchronize()
            self.peak_bytes = torch.cuda.max_memory_allocated() - self.base
        return [a.seconds_to(b) for a, b in zip(self.marks, self.marks[1:])]


def _host_peak_bytes(func, layer_in: Micro) -> int:
    """The most one forward + backward of ``func`` holds at once in activations and temporaries
    it allocates (its kept activations, output and activation gradients; parameters and their
    gradients are counted apart), on CPU, where there is no allocator peak to read: torch's own
    memory tracker (``torch.distributed._tools.mem_tracker``) follows every storage the run
    makes. An untimed run of its own: the tracker slows each op."""
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType

    class Tracker(MemTracker):
        """torch's tracker, which hooks every weight's gradient of a module it enters: a
        module holding frozen weights (which take no hook) is tracked without its gradients'
        hooks, so a LoRA adapter's gradient beside them counts as a temporary (rank × width
        bytes: small beside the layer's activations)."""

        def _track_module_params_and_buffers(self, module, install_grad_hooks=True):
            return super()._track_module_params_and_buffers(
                module, install_grad_hooks and all(p.requires_grad for p in module.parameters()))

    tracker = Tracker()
    with tracker:
        out = func(layer_in)
        outputs = [t for t in _outputs(out) if t.requires_grad]
        if outputs:
            torch.autograd.backward(outputs, [torch.ones_like(t) for t in outputs])
    for p in func.parameters():
        p.grad = None
    # activations and temporaries: the tracker counts the parameters and their gradients apart
    return int(sum(device[kind] for device in tracker.get_tracker_snapshot("peak").values()
                   for kind in (_MemRefType.ACT, _MemRefType.TEMP, _MemRefType.OTH)))


def _selective_bytes(func, layer_in: Micro, live: "_LiveStorages | None") -> int:
    """What one forward of ``func`` under selective recompute keeps beyond its input (the
    outputs of its matmuls and attention kernels, ``vlmshard.train.recompute``), its output
    aside: on a GPU (``live`` None) what the allocator holds more after it, on CPU the
    storages of the tensors alive after it that were not before."""
    if live is None:
        before = torch.cuda.memory_allocated()
        out = run_layer(func, layer_in, "selective")
        return torch.cuda.memory_allocated() - before - sum(
            t.untyped_storage().nbytes() for t in _outputs(out))
    before = live()
    out = run_layer(func, layer_in, "selective")
    kept = {ptr: size for ptr, size in live().items() if ptr not in before}
    for t in _outputs(out):
        kept.pop(t.untyped_storage().data_ptr(), None)
    return sum(kept.values())


# Plain tensors and parameters, by the object's own type: ``isinstance`` asks a weak proxy for
# its referent's class (a dead one raises), and the fake tensors ``torch.compile`` leaves behind
# have no data to point at.
_PLAIN = (torch.Tensor, torch.nn.Parameter)


class _LiveStorages:
    """Called: the storage (address: bytes) of every plain tensor and parameter Python holds.
    After importing torch and ``transformers`` that is a walk over millions of objects (0.3 s;
    a profile asks twice per layer). So the objects alive on entry are walked once, their
    tensors kept by weak reference, and frozen (the permanent generation, which
    ``gc.get_objects`` skips): each call walks those tensors still alive and the objects made
    since, no others."""

    def __enter__(self) -> "_LiveStorages":
        self._entered = [weakref.ref(t) for t in gc.get_objects() if type(t) in _PLAIN]
        gc.freeze()
        return self

    def __exit__(self, *exc) -> None:
        gc.unfreeze()

    def __call__(self) -> dict[int, int]:
        tensors = [t for t in (ref() for ref in self._entered) if t is not None]
        tensors += [t for t in gc.get_objects() if type(t) in _PLAIN]
        return dict(storage for storage in map(_storage, tensors) if storage is not None)


def _storage(t: torch.Tensor) -> tuple[int, int] | None:
    """A tensor's storage as (address, bytes); None for one that has none, as the tensors
    ``torch.compile`` keeps from tracing (symbolic shapes, no data: no activation)."""
    try:
        storage = t.untyped_storage()
        return storage.data_ptr(), storage.nbytes()
    except RuntimeError:  # "invalid python storage": a traced tensor torch's caches hold
        return None


class _SavedBytes:
    """Counts the bytes autograd saves for backward, parameters excluded (they stay anyway)."""

    def __init__(self, parameters: list[torch.Tensor]) -> None:
        self.params = {p.data_ptr() for p in parameters}
        self.seen: set[int] = set()
        self.bytes = 0

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in self.params and ptr not in self.seen:
            self.seen.add(ptr)
            self.bytes += t.untyped_storage().nbytes()
        return t

    @staticmethod
    def unpack(t: torch.Tensor) -> torch.Tensor:
        return t


def layer_kind_window(folder: str) -> dict:
    """The sliding window and its share of ``b`` from the model's layer kinds (analytic), for a
    model that has one: ``b`` is then fitted to each micro-batch's quadratic work as
    ``CostModel.squares`` counts it, which the packer charges."""
    from vlmshard.families import model_sizes
    from vlmshard.io import read_json
    from vlmshard.packing.cost import CostModel

    analytic = CostModel.from_sizes(model_sizes(read_json(os.path.join(folder, "config.json")),
                                                folder))
    return {"window": analytic.window, "window_share": analytic.window_share} \
        if analytic.window else {}


def memory_caps(profile: "Profile", bounds: list[int], machine: Machine) -> dict:
    """``max_qv``, ``max_qt``: the largest caps whose micro-batches the partition ``bounds`` holds
    in ``machine``'s memory (the profiled mean micro-batch scaled up as far as it fits), which
    ``vlmshard pack --cost-model`` takes as its memory bound. Empty when memory bounds nothing."""
    scale = largest_micro_batch_scale(profile.layers, bounds, machine)
    if scale == float("inf"):
        return {}
    mean = {k: float(np.mean([m[k] for m in profile.micro_batches])) for k in ("tiles", "tokens")}
    return {"max_qv": int(scale * mean["tiles"]), "max_qt": int(scale * mean["tokens"])}


def compare_partitions(layers: list[LayerCost], stages: int, machine: Machine,
                       omnibal: int = 5) -> dict:
    """The searched partition next to DeepSpeed's ``parameters`` and ``uniform`` choices and
    OmniBal's best ``omnibal`` neighbourhood candidates other than it, each with the recompute it
    needs and its modelled stage times (None where it cannot fit). ``chosen`` is the search."""
    searched = search_partition(layers, stages, machine)
    options = {"search": searched}
    for method in ("parameters", "uniform"):
        options[method] = evaluate(layers, deepspeed_bounds(layers, stages, method), machine)
    result = {name: describe(p, layers, name) if p else None for name, p in options.items()}
    neighbours = [p for p in omnibal_candidates(layers, stages, machine)
                  if p.bounds != searched.bounds][:omnibal]
    result["omnibal"] = [describe(p, layers, f"omnibal_{i}") for i, p in enumerate(neighbours)]
    result["chosen"] = result["search"]
    return result


def validate_candidates(cfg: ProfileConfig, candidates: list[dict]) -> list[dict]:
    """Train ``cfg.validate_steps`` real steps with each candidate partition; each comes back
    with ``measured_step_s``, the median step time after the warm-up step."""
    from dataclasses import replace

    from .launcher import train_and_read_log

    base = cfg.training_options()
    measured = []
    for candidate in candidates:
        run = replace(base, out=os.path.join(cfg.out, "validate", candidate["name"]),
                      max_steps=cfg.validate_steps, partition=None, resume=None,
                      save_checkpoints=False)
        run.use_partition(candidate)
        log.info("validating %s: bounds %s", candidate["name"], candidate["bounds"])
        times = [r["step_time_s"] for r in train_and_read_log(run)[1:]]
        measured.append({**candidate, "measured_step_s": float(np.median(times))})
    return measured


def describe(partition: Partition, layers: list[LayerCost], name: str) -> dict:
    return {"name": name,
            "bounds": partition.bounds,
            "max_stage_s": partition.max_time_s,
            "stages": [{"layers": [layers[i].name for i in range(s.first, s.end)],
                        "recompute": [layers[i].name for i in s.recompute],
                        "selective": [layers[i].name for i in s.selective],
                        "time_s": s.time_s, "memory_bytes": s.memory_bytes}
                       for s in partition.stages]}
