"""One rank of a world of sequence-parallel groups, launched by ``torch.distributed.run`` from
``test_sp_memory.py``: for each model folder, dtype and degree s (groups of s consecutive ranks,
as ``sequence_parallel_worker.py`` forms them), each rank takes its share of the folder's first
micro-batch and runs the pipeline layers on it, measuring the token embedding (where the media
exchange runs) and every LLM block alone on its real input, as ``vlmshard train profile`` does
on CPU: the bytes autograd saves for its backward (saved-tensor hooks) and the most its forward
and backward hold at once (torch's memory tracker, parameters and their gradients aside). Rank 0
saves every rank's figures. Usage: ``sp_memory_worker.py OUT DEGREES DTYPES FOLDER SHARDS
[FOLDER SHARDS]...`` (``DEGREES``, ``DTYPES``: comma-separated, e.g. ``2,4`` and
``float32,bfloat16``)."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import AsyncCollectiveTensor

from vlmshard.process import skip_collection_at_exit
from vlmshard.shards.loader import ShardDataset
from vlmshard.shards.sequence import share
from vlmshard.train.hf_model import model_layers
from vlmshard.train.profile import (
    _detached,
    _host_peak_bytes,
    _outputs,
    _SavedBytes,
    kept_size,
)
from vlmshard.train.topology import Topology


class SavedBytes(_SavedBytes):
    """The profile's count of saved bytes, through the exchange's outputs: a view of what an
    all-to-all received (a rank's one head of a kind) stays torch's wrapper of the buffer,
    whose own storage is no real one."""

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        super().pack(t.elem if isinstance(t, AsyncCollectiveTensor) else t)
        return t


def measured(layer, micro, needs_grad: bool) -> tuple[int, int]:
    """(kept, peak) bytes of one forward + backward of ``layer`` on ``micro``'s rows."""
    x, carry = _detached(micro, requires_grad=needs_grad)
    layer_in = micro.with_x(x, carry=carry)
    saved = SavedBytes(list(layer.parameters()))
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
        out = layer(layer_in)
    outputs = [t for t in _outputs(out) if t.requires_grad]
    torch.autograd.backward(outputs, [torch.ones_like(t) for t in outputs])
    for p in layer.parameters():
        p.grad = None
    return saved.bytes, _host_peak_bytes(layer, layer_in)


def rank_figures(folder: str, shards: str, dtype: torch.dtype, sp: int,
                 topology: Topology) -> list[dict]:
    model = model_layers(folder)
    layers = model.build_all("cpu", dtype)
    batch = next(iter(ShardDataset(shards, pixel_dtype=dtype)))
    micro = model.first_micro(share(batch, sp, dist.get_rank() % sp,
                                    model.geometry.tokens_per_tile), topology=topology)
    rows = []
    for i, (layer, name) in enumerate(zip(layers, model.names)):
        if name == "embed_tokens" or name.startswith("llm_block"):
            kept, peak = measured(layer, micro, model.input_needs_grad(i))
            at = kept_size(model, i, micro.host)
            rows.append({"folder": folder, "dtype": str(dtype), "sp": sp,
                         "rank": dist.get_rank(), "layer": name, "kept": kept, "peak": peak,
                         "kept_size": (at.tiles, at.tokens),
                         "size": (micro.num_tiles, micro.num_tokens),
                         "image_tokens": micro.host.image_tokens})
        with torch.no_grad():
            out = layer(micro)
        micro = micro.with_output(out, model.defs[i].output)
    return rows


def main(out: str, degrees: list[int], dtypes: list[str], jobs: list[str]) -> None:
    dist.init_process_group("gloo")
    topology = Topology.build(1, dist.get_world_size(), degrees)
    rows = [row for folder, shards in zip(jobs[::2], jobs[1::2]) for name in dtypes
            for sp in degrees
            for row in rank_figures(folder, shards, getattr(torch, name), sp, topology)]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, rows)
    if dist.get_rank() == 0:
        torch.save([row for part in gathered for row in part], out)
    dist.destroy_process_group()


if __name__ == "__main__":
    skip_collection_at_exit()  # as the trainer's ranks
    main(sys.argv[1], [int(a) for a in sys.argv[2].split(",")], sys.argv[3].split(","),
         sys.argv[4:])
