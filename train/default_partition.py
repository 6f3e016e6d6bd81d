"""The stage partition and recompute a run takes, and the peak memory each stage is predicted
to hold with them.

With no ``--partition`` and no ``--bounds``, the exact min-max search of ``vlmshard.partition``
over the model folder's analytic layer costs (``model_sizes.trainer_layer_work``: FLOPs for
time; parameters, kept activations and transients for memory), at the micro-batch sizes the
shards hold (their mean micro-batch for time, the caps for memory: every micro-batch must
fit) and the memory of the rank's device, with the recompute each stage then needs.
``vlmshard train profile`` measures the layers instead; its partition.json (``--partition``)
wins over the search. Whatever the source, each stage's predicted peak is the same analytic
model's at the caps, by part (``vlmshard.partition.stage_memory_parts``), for pipeline.json.

Caps no partition can hold at any recompute are refused before a step runs, in one line naming
the stage and the bytes: a default never plans above the device. The launcher makes the same
choice on its node before it starts any rank (``vlmshard.train.launcher.launch``), so such caps
fail there; rank 0 makes it again for the whole world.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np

from vlmshard.errors import ConfigError
from vlmshard.hardware import GPUS, SUSTAINED_SHARE, gpu_named
from vlmshard.model_sizes import (
    ZERO3_PERSISTENCE_THRESHOLD,
    ModelConfig,
    CostTerms,
    bytes_per_param,
    vit_attention_size,
    weight_bytes_per_param,
    zero3_fixed_bytes,
)
from vlmshard.partition import (
    Machine,
    PartitionError,
    analytic_layer_costs,
    search_partition,
    stage_memory_parts,
)

from .config import TrainConfig

if TYPE_CHECKING:
    from .hf_model import ModelLayers

log = logging.getLogger(__name__)

# A CPU rank (tests, smoke runs): its sustained rate and the bandwidth between two processes'
# stages through gloo on one host; the search needs them only to weigh compute against sends.
CPU_FLOPS_PER_S = 1e11
CPU_LINK_BYTES_PER_S = 5e9


@dataclass(frozen=True)
class Device:
    """A rank's device as the memory model needs it: its name and memory (None: a CPU rank)."""

    name: str
    memory_bytes: int

    @classmethod
    def of_rank(cls, device) -> "Device | None":
        """The torch ``device`` this process trains on."""
        import torch

        if device.type != "cuda":
            return None
        props = torch.cuda.get_device_properties(device)
        return cls(props.name, props.total_memory)

    @classmethod
    def probe(cls) -> "Device | None":
        """The first visible GPU, read in a child process (None without CUDA): the launcher
        stays alive beside the ranks and must hold no CUDA context of its own."""
        code = ("import json, torch; p = torch.cuda.get_device_properties(0) "
                "if torch.cuda.is_available() else None; "
                "print(json.dumps(p and [p.name, p.total_memory]))")
        found = json.loads(subprocess.run([sys.executable, "-c", code], check=True,
                                          capture_output=True, text=True).stdout)
        return cls(*found) if found else None


@dataclass(frozen=True)
class ChosenPartition:
    """Stage bounds and recomputed layers, where they came from, and each stage's predicted
    peak by part at the caps (the log, pipeline.json)."""

    bounds: list[int]
    recompute: list[str]
    source: str
    selective: list[str] = field(default_factory=list)  # recomputed selectively
    memory: list[dict] = field(default_factory=list)
    budget_bytes: int = 0  # what the memory model leaves a stage of this device


def shard_sizes(shards: str, dp: int, model: ModelConfig) -> tuple[CostTerms, CostTerms]:
    """The mean sizes (tiles, tokens, Σ seq_len², supervised tokens from the samples'
    ``loss_tokens``, and a Qwen ViT's squared spans: ``model_sizes.vit_attention_size``) of what
    a rank of ``dp`` trains per micro-batch, over every micro-batch of the shards, and the
    largest micro-batch a rank holds (the caps; in a sequence-parallel group, 1/sp of its tokens
    and attention heads, and the tiles the plan bounds each rank's media to, ``rank_qv``). Each
    record's json member holds its sizes, read alone; a Qwen ViT's attention needs each image's
    patch grid, which only the image's header holds: for those models every record is read whole
    (its images read to their headers, not decoded)."""
    from vlmshard.shards.layout import read_manifest
    from vlmshard.shards.loader import ShardDataset
    from vlmshard.shards.records import decoded_images, tiles_of

    # every rank's records of plain shards; a grouped plan's as one rank of dp reads them
    dataset = ShardDataset(shards, 0, dp if read_manifest(shards).step_groups else 1)
    m = dataset.manifest
    if model.vision.fused_qkv:
        records = ((r.step, r.samples, [im.grid for im in decoded_images(
            r, dataset.policies, rgb=False, own={})]) for r in dataset.records())
    else:
        records = ((meta["step"], meta["samples"], []) for meta in dataset.record_metas())
    sizes = []
    for step, samples, grids in records:
        vit = vit_attention_size(model.vision, grids)
        lengths = [s["seq_len"] for s in samples]
        sizes.append(np.array((tiles_of(samples), sum(lengths), sum(n * n for n in lengths),
                               vit.vit_squares, vit.vit_windows,
                               sum(s["loss_tokens"] for s in samples)), dtype=float)
                     / m.step_group(step)["sp"])
    groups = m.groups or [m.step_group(0)]
    caps = CostTerms(max(g["rank_qv"] for g in groups), max(g["length"] / g["sp"] for g in groups))
    # memory has no squared term: no attention backend keeps an [n x n] score matrix
    tiles, tokens, squares, vit_squares, vit_windows, supervised = np.mean(sizes, axis=0)
    return CostTerms(tiles, tokens, squares, vit_squares=vit_squares, vit_windows=vit_windows,
                     supervised=supervised), caps


def largest_sp(shards: str) -> int:
    """The largest sequence-parallel degree of the shards' packing groups: its exchange keeps
    the most per token (``model_sizes.Saves.sp``), so memory is bounded at it with the largest
    group's caps."""
    from vlmshard.shards.layout import read_manifest

    m = read_manifest(shards)
    return max(g["sp"] for g in (m.groups or [m.step_group(0)]))


def device_machine(device: Device | None, ranks_on_node: int) -> tuple[Machine, float, str]:
    """The partition search's machine for a rank's ``device``, the FLOP rate it assumes, and
    the device in words. A GPU the table (``vlmshard.hardware``) does not know is costed as an
    H100 for its rate; its memory is its own."""
    if device is None:
        pages = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        memory = pages // max(1, ranks_on_node)
        return (Machine(memory, CPU_LINK_BYTES_PER_S), CPU_FLOPS_PER_S,
                f"a CPU rank's share of RAM, {memory / 2**30:.1f} GiB")
    gpu = gpu_named(device.name) or GPUS["h100"]
    machine = Machine.for_device(device.memory_bytes, gpu.link_bytes_per_s)
    return (machine, gpu.peak_flops * SUSTAINED_SHARE,
            f"{device.name}, {device.memory_bytes / 2**30:.0f} GiB")


def choose_partition(cfg: TrainConfig, model: "ModelLayers", device: Device | None,
                     ranks_on_node: int) -> ChosenPartition:
    """The partition ``cfg`` names (the profile's, or ``--bounds``; its own ``--recompute``
    too), else the search's for ``cfg.pp`` stages (see the module docstring), with each
    stage's predicted peak. Raises ConfigError where the search finds no partition that fits."""
    mean, caps = shard_sizes(cfg.shards, cfg.dp, model.sizes())
    machine, flops_per_s, where = device_machine(device, ranks_on_node)
    machine, fixed = less_zero3_fixed(cfg, model, machine, where)
    layers = analytic_layer_costs(
        model.analytic_work(sp=largest_sp(cfg.shards)), time_size=mean, memory_size=caps,
        flops_per_s=flops_per_s,
        bytes_per_param=bytes_per_param(cfg.precision, cfg.dp, cfg.grad_accum, cfg.zero),
        modes=model.modes,
        frozen_bytes_per_param=weight_bytes_per_param(cfg.precision, cfg.dp, cfg.zero))
    basis = (f"the analytic FLOPs and memory of {os.path.basename(model.path)} at micro-batches "
             f"of {mean.tiles:.0f} tiles and {mean.tokens:.0f} tokens (caps {caps.tiles:.0f}/"
             f"{caps.tokens:.0f}), {where}")
    if cfg.bounds is not None:
        bounds, recompute, selective = list(cfg.bounds), list(cfg.recompute), list(cfg.selective)
        source = f"profiled: {cfg.partition}" if cfg.partition else "--bounds"
    else:
        try:
            found = search_partition(layers, cfg.pp, machine)
        except PartitionError as e:
            raise ConfigError(f"the shards' caps ({caps.tiles:.0f} tiles, {caps.tokens:.0f} "
                              f"tokens a micro-batch) do not fit {where}: {e}; pack with smaller "
                              "caps (vlmshard pack --max-qv/--max-qt) or train with more "
                              "--pp stages") from e
        bounds = found.bounds
        recompute = [model.names[i] for i in found.recompute]
        recompute += [n for n in cfg.recompute if n not in recompute]
        selective = [model.names[i] for i in found.selective]
        selective += [n for n in cfg.selective if n not in selective + recompute]
        source = f"searched: {basis}"
    # a frozen prefix keeps nothing: there is nothing to recompute
    runs = dict(zip(model.names, model.modes))
    idle = [n for n in recompute + selective if runs.get(n) == "forward"]
    if idle:
        log.info("not recomputed: %s run forward only (frozen, nothing trained before them)",
                 ", ".join(idle))
    recompute = [n for n in recompute if n not in idle]
    selective = [n for n in selective if n not in idle]
    again = {model.names.index(n) for n in recompute if n in model.names}
    partly = {model.names.index(n) for n in selective if n in model.names} - again
    memory = []
    for s, (first, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        parts = stage_memory_parts(layers, first, end, len(bounds) - 1 - s,
                                   sorted(i for i in again if first <= i < end),
                                   sorted(i for i in partly if first <= i < end))
        parts.update({f"zero3_{name}": n for name, n in fixed.items()})
        memory.append({**parts, "predicted_peak_bytes": sum(parts.values())})
    budget = machine.memory_budget + sum(fixed.values())
    over = [s for s, m in enumerate(memory) if m["predicted_peak_bytes"] > budget]
    if over:
        log.warning("the partition %s is predicted to need %s GiB on stage(s) %s, above the "
                    "%.2f GiB the memory model leaves a stage of %s", bounds,
                    ", ".join(f"{memory[s]['predicted_peak_bytes'] / 2**30:.2f}" for s in over),
                    over, budget / 2**30, where)
    return ChosenPartition(bounds, recompute, source, selective, memory, budget)


def less_zero3_fixed(cfg: TrainConfig, model: "ModelLayers", machine: Machine,
                     where: str) -> tuple[Machine, dict[str, int]]:
    """``machine`` with what a ZeRO-3 rank holds whatever the layers taken from its budget (the
    layers are fitted into the rest), and that by part (``model_sizes.zero3_fixed_bytes``;
    nothing for the other stages). ``where``: the device in words, for the log and the error
    where nothing is left."""
    if cfg.zero != 3:
        return machine, {}
    threshold = cfg.zero3_persistence_threshold
    fixed = zero3_fixed_bytes(model.zero3_weights(
        ZERO3_PERSISTENCE_THRESHOLD if threshold is None else threshold), cfg.precision, cfg.dp)
    held = sum(fixed.values())
    said = (f"ZeRO-3 holds {held / 2**30:.2f} GiB beyond each weight's split ("
            + ", ".join(f"{k} {v / 2**30:.2f}" for k, v in fixed.items()) + " GiB)")
    if held >= machine.memory_budget:
        raise ConfigError(f"{said}: it leaves nothing of {where} for the layers")
    machine = replace(machine, memory_budget=machine.memory_budget - held)
    log.info("%s; the layers get the other %.2f GiB of %s", said, machine.memory_budget / 2**30,
             where)
    return machine, fixed
