"""Joining the world, and moving what the host knows over the topology's gloo groups."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Callable, TypeVar

from vlmshard.errors import ConfigError

from .deepspeed_compat import without_shm_allreduce

if TYPE_CHECKING:
    from .topology import Topology

T = TypeVar("T")


def rank_device(cuda: bool):
    """This process's device, made current: on GPU its ``LOCAL_RANK``'s, set before anything
    touches CUDA (else every rank opens a context on GPU 0 and NCCL's buffers land there)."""
    import torch

    if not cuda:
        return torch.device("cpu")
    local = int(os.environ.get("LOCAL_RANK", 0))
    visible = torch.cuda.device_count()
    if local >= visible:
        shown = os.environ.get("CUDA_VISIBLE_DEVICES", "unset")
        raise ConfigError(f"local rank {local} has no GPU: this node shows {visible} "
                          f"(CUDA_VISIBLE_DEVICES={shown})")
    torch.cuda.set_device(local)
    return torch.device("cuda", local)


def on_rank_0(compute: Callable[[], T], topology: Topology) -> T:
    """``compute()`` on global rank 0, its result sent to every rank: one decision the whole
    world takes, whatever each rank would have read or measured."""
    import torch.distributed as dist

    box = [compute() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0, group=topology.world)
    return box[0]


def from_first_stage(value: T, topology: Topology) -> T:
    """``value`` as this pipeline's first stage has it, on every stage of the pipeline."""
    import torch.distributed as dist

    box = [value]
    dist.broadcast_object_list(box, src=topology.pipeline_first, group=topology.pipeline)
    return box[0]


def to_rank_0(value: T, topology: Topology) -> list[T] | None:
    """Every rank's ``value`` in rank order on global rank 0, which writes the log (None
    elsewhere): each rank sends once, where gathering to all would send world² copies."""
    import torch.distributed as dist

    values = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(value, values, dst=0, group=topology.world)
    return values


def init_distributed(cuda: bool) -> None:
    """Join the process group (NCCL on GPU, gloo on CPU)."""
    import deepspeed

    if not cuda:
        without_shm_allreduce()
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
