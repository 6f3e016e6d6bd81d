"""One rank of a world of sequence-parallel groups, launched by ``torch.distributed.run`` from
``test_sequence_parallel.py``: for each model folder and each degree s, the world's ranks form
groups of s consecutive ranks (the trainer's ``Topology`` at one stage), group d running the
pipeline layers of the folder on its shares of micro-batches d, d + world/s, ... of the folder's
shards folders' micro-batches. Rank 0 saves, per folder and degree, the summed loss and every
gradient summed over the world. One launch serves every folder: each rank imports torch and
``transformers`` once. Usage: ``sequence_parallel_worker.py OUT DEGREES FOLDER SHARDS[,SHARDS...]
[FOLDER SHARDS...]...`` (``DEGREES``: comma-separated)."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from vlmshard.process import skip_collection_at_exit
from vlmshard.shards.loader import ShardDataset
from vlmshard.shards.sequence import share
from vlmshard.train.hf_model import model_layers
from vlmshard.train.pipeline import recompute_modes, run_layers
from vlmshard.train.topology import Topology


def sequence_parallel(folder: str, topology: Topology, shards: list[str]) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = model_layers(folder)
    layers = model.build_all()
    # one LLM block recomputed whole: its exchanges run again in backward, on every rank
    modes = recompute_modes(model.names, {"llm_block_1"}, set(), model)
    batches = [b for path in shards for b in ShardDataset(path, pixel_dtype=torch.float32)]
    results = {}
    for sp in sorted(topology.sequence):
        for layer in layers:
            layer.zero_grad(set_to_none=True)
        total = torch.zeros(())
        for batch in batches[rank // sp::world // sp]:
            micro = model.first_micro(share(batch, sp, rank % sp, model.geometry.tokens_per_tile),
                                      topology=topology)
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
    return results


def main(out: str, degrees: list[int], jobs: list[str]) -> None:
    dist.init_process_group("gloo")
    topology = Topology.build(1, dist.get_world_size(), degrees)
    results = {folder: sequence_parallel(folder, topology, shards.split(","))
               for folder, shards in zip(jobs[::2], jobs[1::2])}
    if dist.get_rank() == 0:
        torch.save(results, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    skip_collection_at_exit()  # as the trainer's ranks
    main(sys.argv[1], [int(a) for a in sys.argv[2].split(",")], sys.argv[3:])
