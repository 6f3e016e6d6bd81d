"""One rank of a sequence-parallel group, launched by ``torch.distributed.run`` from
``test_sequence_parallel.py``: the pipeline layers of a model folder on this rank's share of each
of the first micro-batches of some shards, the summed loss and every gradient summed over the
group, saved by rank 0. Usage: ``sequence_parallel_worker.py FOLDER SHARDS MICRO_BATCHES OUT``."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from vlmshard.shards.loader import ShardDataset
from vlmshard.shards.sequence import share
from vlmshard.train.hf_model import model_layers
from vlmshard.train.pipeline import recompute_modes, run_layers
from vlmshard.train.sequence_parallel import make_groups


def main(folder: str, shards: str, micro_batches: int, out: str) -> None:
    dist.init_process_group("gloo")
    rank, sp = dist.get_rank(), dist.get_world_size()
    make_groups([sp])
    model = model_layers(folder)
    layers = model.build_all()
    # one LLM block recomputed whole: its exchanges run again in backward, on every rank
    modes = recompute_modes(model.names, {"llm_block_1"}, set(), model)
    total = torch.zeros(())
    for batch in list(ShardDataset(shards, pixel_dtype=torch.float32))[:micro_batches]:
        micro = model.first_micro(share(batch, sp, rank, model.geometry.tokens_per_tile))
        loss = run_layers(layers, model.defs, micro, modes).x
        loss.backward()
        total += loss.detach()
    grads = {}
    for layer in layers:
        for local, p in layer.named_parameters():
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            dist.all_reduce(grad)
            grads[layer.hf_name(local)] = grad
    dist.all_reduce(total)
    if rank == 0:
        torch.save({"loss": float(total), "grads": grads}, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4])
