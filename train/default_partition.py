"""The stage partition a run takes when it names none (no ``--partition``, no ``--bounds``).

The exact min-max search of ``vlmshard.partition`` over the model folder's analytic layer costs
(``model_sizes.trainer_layer_work``: FLOPs for time, activation and parameter bytes for memory),
at the micro-batch sizes the shards hold (the mean of their first steps for time, the caps for
memory: every micro-batch must fit) and the memory of the rank's device, with the recompute each
stage then needs. ``vlmshard train profile`` measures the layers instead; its partition.json
(``--partition``) wins over this one. Where the analytic model finds nothing that fits, the run
falls back to DeepSpeed's ``parameters`` partition with a warning: the estimate may be the one
that is wrong.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from itertools import islice
from typing import TYPE_CHECKING

import numpy as np

from vlmshard.hardware import GPUS, SUSTAINED_SHARE, gpu_named
from vlmshard.model_sizes import Size, bytes_per_param
from vlmshard.partition import (
    LayerCost,
    Machine,
    PartitionError,
    analytic_layer_costs,
    deepspeed_bounds,
    search_partition,
)

from .config import TrainConfig

if TYPE_CHECKING:
    from .hf_model import ModelLayers

log = logging.getLogger(__name__)

# A CPU rank (tests, smoke runs): its sustained rate and the bandwidth between two processes'
# stages through gloo on one host; the search needs them only to weigh compute against sends.
CPU_FLOPS_PER_S = 1e11
CPU_LINK_BYTES_PER_S = 5e9
SIZE_STEPS = 4  # steps of records whose sizes stand for the run's micro-batches


@dataclass(frozen=True)
class ChosenPartition:
    """Stage bounds and recomputed layers, and where they came from (the log, pipeline.json)."""

    bounds: list[int]
    recompute: list[str]
    source: str


def given_partition(cfg: TrainConfig) -> ChosenPartition | None:
    """The partition the options name (the profile's, or ``--bounds``), or None."""
    if cfg.bounds is None:
        return None
    source = f"profiled: {cfg.partition}" if cfg.partition else "--bounds"
    return ChosenPartition(list(cfg.bounds), list(cfg.recompute), source)


def shard_sizes(shards: str) -> tuple[Size, Size]:
    """The mean (tiles, tokens, Σ seq_len²) of the records of the shards' first steps, and the
    largest micro-batch their caps allow; read without decoding an image."""
    from vlmshard.shards.loader import ShardDataset

    dataset = ShardDataset(shards, 0, 1)
    m = dataset.manifest
    records = islice(dataset.records(), SIZE_STEPS * m.ranks * m.micro_batches)
    sizes = np.array([(r.tiles, len(r.input_ids), sum(n * n for n in r.seq_lens))
                      for r in records], dtype=float)
    # memory has no squared term: no attention backend keeps an [n x n] score matrix
    return Size(*sizes.mean(axis=0)), Size(m.qv, m.qt)


def device_machine(device, ranks_on_node: int) -> tuple[Machine, float, str]:
    """The partition search's machine for this rank's device, the FLOP rate it assumes, and
    the device in words. A GPU the table (``vlmshard.hardware``) does not know is costed as an
    H100 for its rate; its memory is its own."""
    import torch

    if device.type != "cuda":
        pages = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        memory = pages // max(1, ranks_on_node)
        return (Machine(memory, CPU_LINK_BYTES_PER_S), CPU_FLOPS_PER_S,
                f"a CPU rank's share of RAM, {memory / 2**30:.1f} GiB")
    props = torch.cuda.get_device_properties(device)
    gpu = gpu_named(props.name) or GPUS["h100"]
    machine = Machine.for_device(props.total_memory, gpu.link_bytes_per_s)
    return (machine, gpu.peak_flops * SUSTAINED_SHARE,
            f"{props.name}, {props.total_memory / 2**30:.0f} GiB")


def analytic_costs(model: "ModelLayers", mean: Size, caps: Size, flops_per_s: float,
                   param_bytes: float) -> list[LayerCost]:
    """The trainer's layers costed by the analytic model of the folder's config."""
    return analytic_layer_costs(model.analytic_work(), time_size=mean, memory_size=caps,
                                flops_per_s=flops_per_s, bytes_per_param=param_bytes)


def searched_partition(cfg: TrainConfig, model: "ModelLayers", device,
                       ranks_on_node: int) -> ChosenPartition:
    """The search's partition for ``cfg.pp`` stages (see the module docstring); ``cfg``'s own
    ``--recompute`` layers are recomputed as well."""
    mean, caps = shard_sizes(cfg.shards)
    machine, flops_per_s, where = device_machine(device, ranks_on_node)
    layers = analytic_costs(model, mean, caps, flops_per_s,
                            bytes_per_param(cfg.precision, cfg.dp, cfg.grad_accum))
    basis = (f"the analytic FLOPs and memory of {os.path.basename(model.path)} at micro-batches "
             f"of {mean.tiles:.0f} tiles and {mean.tokens:.0f} tokens (caps {caps.tiles:.0f}/"
             f"{caps.tokens:.0f}), {where}")
    try:
        found = search_partition(layers, cfg.pp, machine)
    except PartitionError as e:
        bounds = deepspeed_bounds(layers, cfg.pp, "parameters")
        log.warning("no partition fits by %s: %s; running DeepSpeed's 'parameters' partition "
                    "%s without recompute", basis, e, bounds)
        return ChosenPartition(bounds, list(cfg.recompute),
                               f"DeepSpeed's 'parameters' (the search found none that fits "
                               f"by {basis})")
    recompute = [model.names[i] for i in found.recompute]
    recompute += [n for n in cfg.recompute if n not in recompute]
    return ChosenPartition(found.bounds, recompute, f"searched: {basis}")
