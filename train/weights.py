"""A model folder's safetensors weights in and out, one pipeline layer at a time.

In: ``Checkpoint`` maps every tensor of the folder (``model.safetensors`` or the shards named by
``model.safetensors.index.json``) to the model's parameter name with ``transformers``' own key
renamings and tensor conversions, as ``from_pretrained`` does (hub checkpoints of Qwen2-VL still
say ``model.layers.0`` where transformers 5 says ``model.language_model.layers.0``; a Qwen3-MoE
checkpoint stores each expert apart where the model holds them fused). ``load_layer`` reads only
the tensors of one layer, so a stage never holds more of the model than its own layers.

Out: each pipeline stage writes its layers to one safetensors shard, in the dtypes the input
stored, and ``write_index`` adds the index and copies config, tokenizer and processor files, so
the folder loads with ``from_pretrained``.
"""

from __future__ import annotations

import contextlib
import copy
import functools
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
    """Where each parameter of ``model`` (built on meta) lies in the folder's safetensors, and
    how to make it from them: ``transformers``' own key renamings and tensor conversions for this
    model (``get_model_conversion_mapping``), applied as ``from_pretrained`` applies them, one
    parameter at a time (a MoE layer's experts stored one by one become its fused tensors)."""

    def __init__(self, folder: str, model: nn.Module) -> None:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (
            WeightConverter,
            WeightRenaming,
            dot_natural_key,
            rename_source_key,
        )

        self.folder = folder
        self.model = model
        transforms = get_model_conversion_mapping(model)
        renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
        converters = [t for t in transforms if isinstance(t, WeightConverter)]
        self.converters = {p: c for c in converters for p in c.source_patterns}
        self.wanted = model.state_dict()
        # parameter name -> its (converter source pattern or None, file, key), in key order
        self.sources: dict[str, list[tuple[str | None, str, str]]] = defaultdict(list)
        for file, keys in weight_files(folder).items():
            for key in keys:
                name, pattern = rename_source_key(key, renamings, converters,
                                                  model.base_model_prefix, self.wanted)
                if name not in self.wanted and key in self.wanted:  # as from_pretrained does
                    name, pattern = key, None
                self.sources[name].append((pattern, file, key))
        for found in self.sources.values():
            found.sort(key=lambda source: dot_natural_key(source[2]))

    def check_complete(self, model: nn.Module) -> None:
        """Every parameter and saved buffer of ``model`` has its tensor in the folder (a tied
        weight counted once, as ``save_pretrained`` stores it)."""
        self._missing([n for n, _ in model.named_parameters()]
                      + [n for n, _ in model.named_buffers() if n in self.wanted])

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        """The tensors of the given parameter names, reading only their sources."""
        self._missing(names)
        with _Files() as files:
            return {name: self._tensor(name, files.tensor) for name in names}

    def dtypes(self, names: list[str]) -> dict[str, torch.dtype]:
        """The dtypes the folder stores the given parameter names in."""
        self._missing(names)
        with _Files() as files:
            return {name: files.dtype(*self.sources[name][0][1:]) for name in names}

    def _tensor(self, name: str, read) -> torch.Tensor:
        sources = self.sources[name]
        pattern = sources[0][0]
        if pattern is None:
            return read(*sources[0][1:])
        converter = copy.deepcopy(self.converters[pattern])  # one instance per parameter
        for source_pattern, file, key in sources:
            converter.add_tensor(name, key, source_pattern,
                                 functools.partial(read, file, key))
        try:
            made = converter.convert(name, model=self.model, config=self.model.config)[name]
        except Exception as e:  # transformers raises what its operation raised
            raise WeightsError(f"{self.folder}: cannot make {name} from "
                               f"{', '.join(k for _, _, k in sources[:3])}: {e}") from e
        return made[0] if isinstance(made, list) else made

    def _missing(self, names: list[str]) -> None:
        missing = [n for n in names if n not in self.sources]
        if missing:
            raise WeightsError(f"{self.folder}: no tensor for {', '.join(missing[:5])}"
                               f"{' ...' if len(missing) > 5 else ''}")


class _Files(contextlib.ExitStack):
    """The safetensors files one read needs, each opened once."""

    def __init__(self) -> None:
        super().__init__()
        self.open: dict[str, object] = {}

    def _handle(self, file: str):
        if file not in self.open:
            self.open[file] = self.enter_context(safe_open(file, "pt"))
        return self.open[file]

    def tensor(self, file: str, key: str) -> torch.Tensor:
        return self._handle(file).get_tensor(key)

    def dtype(self, file: str, key: str) -> torch.dtype:
        return _DTYPES[self._handle(file).get_slice(key).get_dtype()]


def load_layer(layer: nn.Module, checkpoint: Checkpoint, device: torch.device | str = "cpu",
               dtype: torch.dtype = torch.float32) -> nn.Module:
    """Allocate a meta-built layer on ``device`` and fill every tensor from the checkpoint."""
    local = layer.state_dict()
    restored = layer.restored_buffers()
    unsaved = [n for n, _ in layer.named_buffers() if n not in local and n not in restored]
    if unsaved:
        raise WeightsError(f"{type(layer).__name__} holds buffers no checkpoint stores: "
                           f"{unsaved}")
    names = {n: layer.hf_name(n) for n in local}
    tensors = checkpoint.read(list(names.values()))
    layer.to_empty(device=device)
    # assigned, not copied: a copy into the meta-built tensors would keep the config's dtype
    layer.load_state_dict({n: tensors[hf].to(device, dtype) for n, hf in names.items()},
                          strict=True, assign=True)
    for name, make in restored.items():
        buffer = layer.get_buffer(name)
        buffer.copy_(make().to(buffer.dtype))
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
