"""A model folder's safetensors weights in and out, one pipeline layer at a time.

In: ``Checkpoint`` maps every tensor of the folder (``model.safetensors`` or the shards named by
``model.safetensors.index.json``) to the model's parameter name with ``transformers``' own key
renamings, as ``from_pretrained`` does (hub checkpoints of Qwen2-VL still say ``model.layers.0``
where transformers 5 says ``model.language_model.layers.0``). ``load_layer`` reads only the
tensors of one layer, so a stage never holds more of the model than its own layers.

Out: each pipeline stage writes its layers to one safetensors shard, in the dtypes the input
stored, and ``write_index`` adds the index and copies config, tokenizer and processor files, so
the folder loads with ``from_pretrained``.
"""

from __future__ import annotations

import json
import os
import shutil
from collections import defaultdict

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from vlmshard.errors import InputError
from vlmshard.io import fsync_path

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
           "BF16": torch.bfloat16}


class WeightsError(InputError):
    """A model folder whose weights cannot be read: the message names the file or tensor."""


def weight_files(folder: str) -> dict[str, list[str]]:
    """Each safetensors file of the folder and the tensor keys it holds."""
    index = os.path.join(folder, INDEX)
    if os.path.exists(index):
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
        files: dict[str, list[str]] = defaultdict(list)
        for key, file in weight_map.items():
            files[os.path.join(folder, file)].append(key)
        return dict(files)
    single = os.path.join(folder, SINGLE)
    if not os.path.exists(single):
        raise WeightsError(f"{folder}: no {SINGLE} or {INDEX} (only safetensors weights are "
                           "read; save the model with save_pretrained)")
    with safe_open(single, "pt") as f:
        return {single: list(f.keys())}


class Checkpoint:
    """Where each parameter of ``model`` (built on meta) lies in the folder's safetensors."""

    def __init__(self, folder: str, model: nn.Module) -> None:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming, rename_source_key

        self.folder = folder
        files = weight_files(folder)
        transforms = get_model_conversion_mapping(model)
        renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
        if len(renamings) != len(transforms):
            raise WeightsError(f"{folder}: this model's checkpoints need tensor conversions "
                               "(not only renamings), which the per-stage loader does not do")
        self.wanted = model.state_dict()
        self.where: dict[str, tuple[str, str]] = {}
        for file, keys in files.items():
            for key in keys:
                name, _ = rename_source_key(key, renamings, [], model.base_model_prefix,
                                            self.wanted)
                self.where[name] = (file, key)

    def check_complete(self, model: nn.Module) -> None:
        """Every parameter and saved buffer of ``model`` has its tensor in the folder (a tied
        weight counted once, as ``save_pretrained`` stores it)."""
        self._missing([n for n, _ in model.named_parameters()]
                      + [n for n, _ in model.named_buffers() if n in self.wanted])

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        """The tensors of the given parameter names, reading only those."""
        return self._each_file(names, lambda f, key: f.get_tensor(key))

    def dtypes(self, names: list[str]) -> dict[str, torch.dtype]:
        """The dtypes the folder stores the given parameter names in."""
        return self._each_file(names, lambda f, key: _DTYPES[f.get_slice(key).get_dtype()])

    def _missing(self, names: list[str]) -> None:
        missing = [n for n in names if n not in self.where]
        if missing:
            raise WeightsError(f"{self.folder}: no tensor for {', '.join(missing[:5])}"
                               f"{' ...' if len(missing) > 5 else ''}")

    def _each_file(self, names: list[str], get) -> dict:
        """``get(open file, key)`` for each name, opening every file once."""
        self._missing(names)
        by_file: dict[str, list[str]] = defaultdict(list)
        for name in names:
            by_file[self.where[name][0]].append(name)
        out = {}
        for file, file_names in by_file.items():
            with safe_open(file, "pt") as f:
                for name in file_names:
                    out[name] = get(f, self.where[name][1])
        return out


def load_layer(layer: nn.Module, checkpoint: Checkpoint, device: torch.device | str = "cpu",
               dtype: torch.dtype = torch.float32) -> nn.Module:
    """Allocate a meta-built layer on ``device`` and fill every tensor from the checkpoint."""
    local = layer.state_dict()
    unsaved = [n for n, _ in layer.named_buffers() if n not in local]
    if unsaved:
        raise WeightsError(f"{type(layer).__name__} holds buffers no checkpoint stores: "
                           f"{unsaved}")
    names = {n: layer.hf_name(n) for n in local}
    tensors = checkpoint.read(list(names.values()))
    layer.to_empty(device=device)
    layer.load_state_dict({n: tensors[hf].to(dtype) for n, hf in names.items()}, strict=True)
    return layer


def shard_name(stage: int, stages: int) -> str:
    return f"model-{stage + 1:05d}-of-{stages:05d}.safetensors"


def write_shard(folder: str, stage: int, stages: int,
                tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """One stage's tensors as one safetensors file in ``folder``; returns name -> file."""
    os.makedirs(folder, exist_ok=True)
    name = shard_name(stage, stages)
    path = os.path.join(folder, name)
    save_file({k: t.detach().to("cpu").contiguous() for k, t in tensors.items()},
              path + ".tmp", metadata={"format": "pt"})
    fsync_path(path + ".tmp")
    os.replace(path + ".tmp", path)
    return {k: name for k in tensors}


def write_index(folder: str, source: str, weight_map: dict[str, str]) -> None:
    """The shards' index, and every non-weight file of the source folder (config, tokenizer,
    processor, chat template) copied next to them."""
    total = 0
    for file in sorted(set(weight_map.values())):
        with safe_open(os.path.join(folder, file), "pt") as f:
            for key in f.keys():
                piece = f.get_slice(key)
                count = 1
                for d in piece.get_shape():
                    count *= d
                total += count * torch.empty((), dtype=_DTYPES[piece.get_dtype()]).element_size()
    for entry in sorted(os.listdir(source)):
        path = os.path.join(source, entry)
        if os.path.isfile(path) and not _is_weights(entry):
            shutil.copy2(path, os.path.join(folder, entry))
    with open(os.path.join(folder, INDEX), "w", encoding="utf-8") as f:
        json.dump({"metadata": {"total_size": total},
                   "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
    fsync_path(os.path.join(folder, INDEX))


def _is_weights(name: str) -> bool:
    return name.endswith((".safetensors", ".bin", ".pt", ".pth")) or name == INDEX
