"""Save the pipeline's weights as a Hugging Face folder that ``from_pretrained`` loads.

Every stage writes its own layers (data-parallel rank 0 of the stage) to one safetensors shard,
in the dtypes the input folder stored and under the names ``save_pretrained`` would write
(``transformers``' reverted key renamings: hub-format names, which other tools read too);
global rank 0 then
writes the index and copies config, tokenizer and processor files. The folder is assembled as
``FOLDER.partial`` and renamed when complete, so an existing ``FOLDER`` is always a whole one.
The folder must be on storage every node sees.
"""

from __future__ import annotations

import os
import shutil

import torch

from . import deepspeed_compat as ds
from .hf_model import ModelLayers
from .pipeline import VLMPipeline
from .weights import write_index, write_shard


def checkpoint_tensors(model: ModelLayers, layers: dict[int, torch.nn.Module]
                       ) -> dict[str, torch.Tensor]:
    """The tensors of ``layers`` (layer index -> its built layer) under their checkpoint names;
    a tied head's copy left out, since the embedding's layer holds the weight."""
    out = {}
    for i, layer in layers.items():
        if model.first_of_tie(i):
            for local, tensor in layer.state_dict().items():
                out[layer.hf_name(local)] = tensor
    return out


def save_hf(net: VLMPipeline, engine, folder: str) -> None:
    """Write ``folder`` from every stage (a collective: every rank calls it)."""
    tensors = None
    if engine.grid.get_data_parallel_id() == 0:
        tensors = checkpoint_tensors(net.model, {
            i: ds.layer_module(net, i, net.model.defs[i].tied_key).inner
            for i in net.layer_indices})
    write_folder(net.model, tensors, engine.stage_id, engine.num_stages, folder)


def save_hf_data_parallel(model, zero_stage: int, folder: str) -> None:
    """Write ``folder`` from a ``VLMModel`` (``--pp 1``): rank 0 writes every tensor, gathered
    from the ranks' partitions under ZeRO-3 (a collective: every rank calls it)."""
    import contextlib

    import deepspeed

    gathered = (deepspeed.zero.GatheredParameters(list(model.parameters()))
                if zero_stage == 3 else contextlib.nullcontext())
    with gathered:  # copies: ZeRO-3 frees the gathered parameters on leaving
        tensors = ({k: t.detach().clone() for k, t in checkpoint_tensors(
            model.model, dict(enumerate(model.ordered))).items()}
                   if torch.distributed.get_rank() == 0 else None)
    write_folder(model.model, tensors, 0, 1, folder)


def write_folder(model: ModelLayers, tensors: dict[str, torch.Tensor] | None, stage: int,
                 stages: int, folder: str) -> None:
    """Each stage's ``tensors`` (None on the ranks that write none) as its shard of ``folder``;
    rank 0 adds the index and the folder's other files (a collective)."""
    dist = torch.distributed
    partial = folder + ".partial"
    if dist.get_rank() == 0:
        shutil.rmtree(partial, ignore_errors=True)
    dist.barrier()
    weight_map = {}
    if tensors is not None:
        from transformers.core_model_loading import revert_weight_conversion

        dtypes = model.checkpoint.dtypes(list(tensors))
        tensors = {name: tensor.to(dtypes[name]) for name, tensor in tensors.items()}
        tensors = revert_weight_conversion(model.meta, tensors)
        weight_map = write_shard(partial, stage, stages, tensors)
    maps = [None] * dist.get_world_size()
    dist.all_gather_object(maps, weight_map)
    if dist.get_rank() == 0:
        write_index(partial, model.path, {k: v for m in maps for k, v in m.items()})
        shutil.rmtree(folder, ignore_errors=True)
        os.replace(partial, folder)
    dist.barrier()
