"""Process-group set-up for the training ranks, and the gloo groups beside the engine's."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, TypeVar

from vlmshard.errors import ConfigError

from .deepspeed_compat import without_shm_allreduce

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


def on_rank_0(compute: Callable[[], T], groups: SideGroups) -> T:
    """``compute()`` on global rank 0, its result sent to every rank: one decision the whole
    world takes, whatever each rank would have read or measured."""
    import torch.distributed as dist

    box = [compute() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0, group=groups.world)
    return box[0]


@dataclass
class SideGroups:
    """gloo groups beside the engine's (NCCL on GPU): what the host knows (a micro-batch's
    sizes, token counts, timings) crosses them without touching a device."""

    pipe: object  # this rank's pipeline: its stages, one rank each
    pipe_first: int  # the global rank of its first stage, which reads the data
    world: object  # every rank


def side_groups(topology) -> SideGroups:
    """The gloo groups of a ``PipeDataParallelTopology`` (every rank creates every group, in
    the same order, as ``new_group`` requires)."""
    import torch.distributed as dist

    rank = dist.get_rank()
    mine = None
    for ranks in topology.get_axis_comm_lists("pipe"):
        group = dist.new_group(ranks, backend="gloo")
        if rank in ranks:
            mine = group
    first = topology.get_rank(pipe=0, data=topology.get_coord(rank).data)
    return SideGroups(mine, first, dist.new_group(backend="gloo"))


def from_first_stage(value: T, groups: SideGroups) -> T:
    """``value`` as this pipeline's first stage has it, on every stage of the pipeline."""
    import torch.distributed as dist

    box = [value]
    dist.broadcast_object_list(box, src=groups.pipe_first, group=groups.pipe)
    return box[0]


def init_distributed(cuda: bool) -> None:
    """Join the process group (NCCL on GPU, gloo on CPU)."""
    import deepspeed

    if not cuda:
        without_shm_allreduce()
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
