"""Process-group set-up for the training ranks, and the DeepSpeed side effects it must undo."""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"


def shm_segment_name(rank: int) -> str:
    """The POSIX shared-memory segment DeepSpeed's CPU comm op creates for ``rank``.

    Its ``shm_initialize`` names it from the uid, ``MASTER_ADDR``, ``MASTER_PORT`` and the rank,
    and never unlinks it: 69 MB per rank per run stay in ``/dev/shm`` (RAM) until reboot."""
    return (f"deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}_"
            f"{os.environ.get('MASTER_PORT', '')}_{rank}")


def init_distributed(cuda: bool) -> None:
    """Join the process group (NCCL on GPU, gloo on CPU).

    On CPU, once every rank has mapped its peers' segments (the barrier), each rank unlinks its
    own: the mappings live on until the processes exit, and a crash leaves nothing behind."""
    import deepspeed
    import torch.distributed as dist

    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
    if cuda:
        return
    dist.barrier()
    path = os.path.join(SHM_DIR, shm_segment_name(dist.get_rank()))
    try:
        os.unlink(path)
    except FileNotFoundError:  # the op was not built, or ranks span hosts: no segment
        pass
    else:
        log.debug("unlinked %s", path)
