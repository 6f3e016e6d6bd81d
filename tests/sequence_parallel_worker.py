"""One rank of a world of sequence-parallel groups, launched by ``torch.distributed.run`` from
``test_sequence_parallel.py``: for each degree s, the world's ranks form groups of s
consecutive ranks (as the trainer's ``make_groups``), group d running the pipeline layers of a
model folder on its shares of micro-batches d, d + world/s, ... of some
shards folders' micro-batches. Rank 0 saves, per degree, the summed loss and every gradient
summed over the world. Usage: ``sequence_parallel_worker.py FOLDER OUT DEGREES SHARDS...``
(``DEGREES``: comma-separated)."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from vlmshard.process import skip_collection_at_exit
from vlmshard.shards.loader import ShardDataset
from vlmshard.shards.sequence import share
from vlmshard.train.hf_model import model_layers
from vlmshard.train.pipeline import recompute_modes, run_layers
from vlmshard.train.sequence_parallel import make_groups


def main(folder: str, out: str, degrees: list[int], shards: list[str]) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    make_groups(degrees)
    model = model_layers(folder)
    layers = model.build_all()
    # one LLM block recomputed whole: its exchanges run again in backward, on every rank
    modes = recompute_modes(model.names, {"llm_block_1"}, set(), model)
    batches = [b for path in shards for b in ShardDataset(path, pixel_dtype=torch.float32)]
    results = {}
    for sp in degrees:
        for layer in layers:
            layer.zero_grad(set_to_none=True)
        total = torch.zeros(())
        for batch in batches[rank // sp::world // sp]:
            micro = model.first_micro(share(batch, sp, rank % sp, model.geometry.tokens_per_tile))
            loss = run_layers(layers, model.defs, micro, modes).x
            loss.backward()
            total += loss.detach()
        grads = {}
        for layer in layers:
            for local, p in layer.named_parameters():
                grad = p.grad.clone() if p.grad is not None else torch.zeros_like(p)
                dist.all_reduce(grad)
                grads[layer.hf_name(local)] = grad
        dist.all_reduce(total)
        results[sp] = {"loss": float(total), "grads": grads}
    if rank == 0:
        torch.save(results, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    skip_collection_at_exit()  # as the trainer's ranks
    main(sys.argv[1], sys.argv[2], [int(a) for a in sys.argv[3].split(",")], sys.argv[4:])
