"""LoRA on the LLM's decoder blocks through PEFT: adapters added to a built layer, folded into
their weights for a merged folder, and saved as the adapter folder PEFT loads.

Each decoder block (``recipe.Lora``) takes PEFT's own LoRA layers
(``peft.inject_adapter_in_model``) on its targeted linear layers, after its weights are loaded:
the weights stay frozen and the adapters train. The adapters of block i are initialized from
``seed`` and i, so every stage makes the same ones whichever layers it holds. The adapter
folder holds ``adapter_config.json`` and ``adapter_model.safetensors`` under the names
``PeftModel.save_pretrained`` writes (``base_model.model.`` + the module path in the
``transformers`` model, the adapter's name left out), its targets a pattern of the LLM's
decoder blocks alone, so ``peft.PeftModel.from_pretrained`` adds exactly these adapters to the
``transformers`` model; the modules trained in full beside them (a projector) are its
``modules_to_save``, saved whole.
"""

from __future__ import annotations

import os
import re

import torch
from torch import nn

from vlmshard.io import fsync_path
from vlmshard.recipe import Lora

ADAPTER = "default"  # PEFT's name for a model's one adapter


def lora_config(lora: Lora, target_modules):
    from peft import LoraConfig

    return LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                      target_modules=target_modules)


def targeted(module: nn.Module, lora: Lora) -> list[str]:
    """The linear layers of ``module`` LoRA adapts: those named as a target (PEFT matches a
    name or its last component)."""
    return [name for name, m in module.named_modules()
            if isinstance(m, nn.Linear) and name.rsplit(".", 1)[-1] in lora.targets]


def add_adapters(block: nn.Module, lora: Lora, index: int) -> None:
    """PEFT's LoRA layers on ``block``'s targeted linear layers, in their weights' dtype and
    device, initialized from ``lora.seed`` and the layer's ``index``; only they train."""
    from peft import inject_adapter_in_model

    names = targeted(block, lora)
    if not names:
        return  # a block without targets (a linear-attention block's mixer, say) stays frozen
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(lora.seed * 1_000_003 + index)
        inject_adapter_in_model(lora_config(lora, list(lora.targets)), block)
    for name, p in block.named_parameters():
        if ".lora_" in name:
            base = block.get_submodule(name.split(".lora_")[0]).get_base_layer().weight
            p.data = p.data.to(base.device, base.dtype)
            p.requires_grad_(True)


def lora_modules(layer: nn.Module) -> dict[str, nn.Module]:
    """The LoRA layers inside ``layer``, by their local names."""
    from peft.tuners.lora import LoraLayer

    return {name: m for name, m in layer.named_modules() if isinstance(m, LoraLayer)}


def merged_state(layer: nn.Module) -> dict[str, torch.Tensor]:
    """``layer``'s tensors by their local names as without adapters: each adapted weight with
    its adapter folded in (PEFT's ``get_delta_weight``: alpha / rank × B·A), the adapters
    themselves left out."""
    adapted = lora_modules(layer)
    out = {}
    for local, tensor in layer.state_dict().items():
        if ".lora_" in local:
            continue
        owner, _, rest = local.rpartition(".base_layer.")
        if owner in adapted:
            local = f"{owner}.{rest}"
            if rest == "weight":
                delta = adapted[owner].get_delta_weight(ADAPTER)
                tensor = (tensor.float() + delta.float()).to(tensor.dtype)
        out[local] = tensor
    return out


def adapter_tensors(layer, whole: bool = False) -> dict[str, torch.Tensor]:
    """The adapters of a built pipeline layer (``HFLayer``), or with ``whole`` all its tensors
    (a layer trained in full beside them: PEFT's ``modules_to_save``), under the names PEFT
    saves: ``base_model.model.`` + the tensor's path in the ``transformers`` model, without
    the adapter's name."""
    return {"base_model.model." + layer.hf_name(local).replace(f".{ADAPTER}.", "."): t
            for local, t in layer.state_dict().items() if whole or ".lora_" in local}


def target_pattern(block_paths: list[str], lora: Lora) -> str:
    """PEFT's ``target_modules`` as a pattern PEFT matches whole against the ``transformers``
    model's module names: the targets inside the decoder blocks at ``block_paths`` only (a
    ViT's MLP may name its layers alike)."""
    stems = sorted({re.escape(re.sub(r"\.\d+$", "", p)) for p in block_paths})
    return (rf"(?:{'|'.join(stems)})\.\d+\.(?:.*\.)?"
            rf"(?:{'|'.join(map(re.escape, lora.targets))})")


def write_adapter(folder: str, tensors: dict[str, torch.Tensor], config) -> None:
    """The PEFT adapter folder of ``config`` (``ModelLayers.peft_config``): its
    ``adapter_config.json`` and ``tensors`` as ``adapter_model.safetensors``, assembled as
    ``FOLDER.partial`` and renamed when complete."""
    import shutil

    from safetensors.torch import save_file

    partial = folder + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    os.makedirs(partial)
    config.save_pretrained(partial)
    path = os.path.join(partial, "adapter_model.safetensors")
    save_file({k: t.detach().to("cpu").contiguous() for k, t in sorted(tensors.items())}, path,
              metadata={"format": "pt"})
    for name in os.listdir(partial):
        fsync_path(os.path.join(partial, name))
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(partial, folder)
