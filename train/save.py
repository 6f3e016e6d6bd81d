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
from .pipeline import VLMPipeline
from .weights import write_index, write_shard


def stage_tensors(net: VLMPipeline) -> dict[str, torch.Tensor]:
    """This stage's tensors under their checkpoint names (a tied head's copy left out: the
    embedding's stage writes it)."""
    out = {}
    for i in net.layer_indices:
        d = net.model.defs[i]
        if not net.model.first_of_tie(i):
            continue
        layer = ds.layer_module(net, i, d.tied_key).inner
        for local, tensor in layer.state_dict().items():
            out[layer.hf_name(local)] = tensor
    return out


def save_hf(net: VLMPipeline, engine, folder: str) -> None:
    """Write ``folder`` from every stage (a collective: every rank calls it)."""
    dist = torch.distributed
    partial = folder + ".partial"
    if dist.get_rank() == 0:
        shutil.rmtree(partial, ignore_errors=True)
    dist.barrier()
    weight_map = {}
    if engine.grid.get_data_parallel_id() == 0:
        from transformers.core_model_loading import revert_weight_conversion

        tensors = stage_tensors(net)
        dtypes = net.model.checkpoint.dtypes(list(tensors))
        tensors = {name: tensor.to(dtypes[name]) for name, tensor in tensors.items()}
        tensors = revert_weight_conversion(net.model.meta, tensors)
        weight_map = write_shard(partial, engine.stage_id, engine.num_stages, tensors)
    maps = [None] * dist.get_world_size()
    dist.all_gather_object(maps, weight_map)
    if dist.get_rank() == 0:
        write_index(partial, net.model.path, {k: v for m in maps for k, v in m.items()})
        shutil.rmtree(folder, ignore_errors=True)
        os.replace(partial, folder)
    dist.barrier()
