"""Save the pipeline's weights as a Hugging Face folder that ``from_pretrained`` loads (under
LoRA: PEFT's adapter folder, and the merged weights where asked).

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
from .lora import adapter_tensors, merged_state, write_adapter
from .pipeline import VLMPipeline
from .weights import write_index, write_shard


def checkpoint_tensors(model: ModelLayers, layers: dict[int, torch.nn.Module]
                       ) -> dict[str, torch.Tensor]:
    """The tensors of ``layers`` (layer index -> its built layer) under their checkpoint names,
    LoRA's adapters folded into their weights; a tied head's copy left out, since the
    embedding's layer holds the weight."""
    out = {}
    for i, layer in layers.items():
        if model.first_of_tie(i):
            state = merged_state(layer) if model.recipe.lora else layer.state_dict()
            for local, tensor in state.items():
                out[layer.hf_name(local)] = tensor
    return out


def save_model(model: ModelLayers, layers: dict[int, torch.nn.Module] | None, stage: int,
               stages: int, root: str, merge: bool) -> None:
    """The trained model under ``root`` from every stage's ``layers`` (layer index -> its built
    layer; None on the ranks that write none; a collective): ``hf/``, or under LoRA the PEFT
    adapter folder ``adapter/``, and ``hf/`` with the adapters folded in where ``merge``
    asks."""
    if model.recipe.lora:
        tensors = None if layers is None else {
            k: t.detach().clone() for i, layer in layers.items()
            if model.modes[i] in ("lora", "train") and model.first_of_tie(i)
            for k, t in adapter_tensors(layer, whole=model.modes[i] == "train").items()}
        rank_0 = torch.distributed.get_rank() == 0  # the one rank that writes the folder
        pieces = [None] * torch.distributed.get_world_size() if rank_0 else None
        torch.distributed.gather_object(tensors and {k: t.cpu() for k, t in tensors.items()},
                                        pieces, dst=0)
        if rank_0:
            write_adapter(os.path.join(root, "adapter"),
                          {k: t for piece in pieces if piece for k, t in piece.items()},
                          model.peft_config())
        torch.distributed.barrier()
        if not merge:
            return
    tensors = None if layers is None else {k: t.detach().clone() for k, t in
                                           checkpoint_tensors(model, layers).items()}
    write_folder(model, tensors, stage, stages, os.path.join(root, "hf"))


def save_hf(net: VLMPipeline, engine, root: str, merge: bool) -> None:
    """``save_model`` from every stage of the pipeline (a collective)."""
    layers = None
    if engine.grid.get_data_parallel_id() == 0:
        layers = {i: ds.layer_module(net, i, net.model.defs[i].tied_key).inner
                  for i in net.layer_indices}
    save_model(net.model, layers, engine.stage_id, engine.num_stages, root, merge)


def save_hf_data_parallel(model, zero_stage: int, root: str, merge: bool) -> None:
    """``save_model`` from a ``VLMModel`` (``--pp 1``): rank 0 writes every tensor, gathered
    from the ranks' partitions under ZeRO-3 (a collective: every rank calls it)."""
    import contextlib

    import deepspeed

    gathered = (deepspeed.zero.GatheredParameters(list(model.parameters()))
                if zero_stage == 3 else contextlib.nullcontext())
    with gathered:  # copies (save_model's): ZeRO-3 frees the gathered parameters on leaving
        save_model(model.model, dict(enumerate(model.ordered))
                   if torch.distributed.get_rank() == 0 else None, 0, 1, root, merge)


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
