"""A Hugging Face model folder as the trainer's layer list: read, built on ``meta``, loaded per
layer.

``model_layers(path, backend, kernels)`` reads the folder's config, picks the family from its
``model_type`` (``vlmshard.families``), builds the whole ``transformers`` model on the ``meta``
device (free, whatever its size) with the chosen attention backend, and lists its pipeline
layers (its family's map in ``vlmshard.train.models``). ``build_layer`` then materializes one
layer with its own tensors only, with the optional kernels ``kernels`` switches on.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
from torch import nn

from vlmshard.errors import ConfigError
from vlmshard.families import family_for_model_type, model_sizes, read_model_folder
from vlmshard.io import read_json
from vlmshard.recipe import Recipe, input_needs_grad
from vlmshard.model_sizes import (
    LayerWork,
    ModelConfig,
    Saves,
    Zero3Weights,
    trainer_layer_work,
    with_adapters,
)

from .attention import choose_backend, implementation, repeats_kv_heads, supports_runs
from .clock import layer_part
from .kernels import Kernels
from .lora import add_adapters, lora_config, target_pattern, targeted
from .micro import HostMeta, Micro, Phase, from_wire, wire_inputs
from .models import liger
from .models.layers import Geometry, LayerDef
from .weights import Checkpoint, load_layer

if TYPE_CHECKING:
    from .topology import Topology

log = logging.getLogger(__name__)


@dataclass
class ModelLayers:
    path: str
    family: str
    backend: str  # attention backend (vlmshard.train.attention)
    config: object  # the transformers config
    meta: nn.Module  # the whole model on the meta device
    defs: list[LayerDef]
    geometry: Geometry
    kernels: Kernels  # the optional kernels each built layer takes
    recipe: Recipe  # what trains

    @property
    def names(self) -> list[str]:
        return [d.name for d in self.defs]

    @functools.cached_property
    def modes(self) -> list[str]:
        """Per layer, how it runs under the recipe: ``forward``, ``input_grad`` or ``train``
        (``vlmshard.recipe``)."""
        return self.recipe.modes(self.names, tied=any(d.tied_key for d in self.defs))

    def input_needs_grad(self, index: int) -> bool:
        """Whether the input of layer ``index`` needs its gradient: a layer before it trains.
        Where none does, the stage holding it takes its input detached and sends no gradient
        back."""
        return input_needs_grad(self.modes, index)

    def input_phase(self, index: int) -> Phase:
        """What layer ``index`` receives: pixels for the first, else its predecessor's output."""
        if index == 0:
            return Phase("pixels", self.geometry.pixel_rows_per_tile)
        return self.defs[index - 1].output

    def first_micro(self, batch: dict, device: torch.device | str = "cpu",
                    topology: Topology | None = None) -> Micro:
        """A loader batch as the first layer's micro-batch, where one process runs every layer
        (the profile, tests; a sequence-parallel share exchanges over ``topology``'s group)."""
        wire = tuple(t.to(device) for t in wire_inputs(batch))
        host = HostMeta.of_batch(batch, self.geometry)
        return from_wire(wire, host, self.input_phase(0), self.backend, topology)

    def sizes(self) -> ModelConfig:
        """The analytic model of the folder's config (``vlmshard.families.model_sizes``)."""
        return model_sizes(read_json(os.path.join(self.path, "config.json")), self.path)

    def analytic_work(self, dtype: torch.dtype = torch.bfloat16, sp: int = 1) -> list[LayerWork]:
        """Per layer, its work in the analytic model of the folder's config (FLOPs, parameters
        and the activation bytes it keeps with this model's kernels, built in ``dtype``, on a
        rank of a sequence-parallel group of ``sp``: ``model_sizes.trainer_layer_work``; LoRA's
        adapters: ``model_sizes.with_adapters``)."""
        sizes, saves = self.sizes(), replace(self.saves(dtype), sp=sp)
        return with_adapters(trainer_layer_work(self.names, sizes, saves), sizes,
                             self.recipe.lora, saves)

    def saves(self, dtype: torch.dtype = torch.bfloat16) -> Saves:
        """Where the layers this model builds keep other tensors for backward than
        ``transformers``' own modules on SDPA (``model_sizes.Saves``): the ViT's attention in
        one call of torch's varlen kernel, K/V heads repeated for it, Liger's kernels in the
        parts that take them (not in compiled blocks) where they swap a module of the part's
        first block; and the width of their activations, built in ``dtype``."""
        k = self.kernels

        def liger_in(kind: str) -> bool:
            layer = next((d for d in self.defs if d.kind.startswith(kind)), None)
            return (k.liger and kind.removesuffix("_block") not in k.compile_blocks
                    and layer is not None and liger.fuses(layer.build(self.meta)))

        return Saves(vit_one_call=k.vit_varlen and self.backend == "varlen" and not k.sdpa_cudnn,
                     liger_llm=liger_in("llm_block"), liger_vit=liger_in("vit_block"),
                     liger_projector=liger_in("projector"),
                     kv_repeated=repeats_kv_heads(self.backend), element_bytes=dtype.itemsize)

    def as_recipe(self, model: nn.Module) -> nn.Module:
        """A ``transformers`` model of this folder trained as the trainer trains its layers, for
        a trainer of one's own or a peer run on the same recipe: ``requires_grad`` set as on
        the layers (each layer's submodules found by their paths, ``HFLayer.paths``), and under
        LoRA the model wrapped by PEFT with the same adapters (``peft_config``; initialized by
        PEFT, not from the trainer's seed)."""
        trains = {}
        for d, mode in zip(self.defs, self.modes):
            for path in d.build(self.meta).paths.values():
                trains[path] = trains.get(path, False) or mode == "train"
        for name, p in model.named_parameters():
            owner = max((path for path in trains if name.startswith(path + ".")), key=len,
                        default=None)
            if owner is None:
                raise ConfigError(f"{name} of {self.path} is in none of the trainer's layers")
            p.requires_grad_(trains[owner])
        if self.recipe.lora is None:
            return model
        from peft import get_peft_model

        return get_peft_model(model, self.peft_config())

    def peft_config(self):
        """PEFT's ``LoraConfig`` of the recipe's adapters on the ``transformers`` model: its
        targets a pattern of the LLM's decoder blocks alone (``lora.target_pattern``), the
        modules trained in full beside them its ``modules_to_save``."""
        config = lora_config(self.recipe.lora, target_pattern(list(self.lora_blocks()),
                                                              self.recipe.lora))
        config.base_model_name_or_path = self.path
        config.modules_to_save = self.trained_modules() or None
        return config

    def parameter_count(self, index: int) -> int:
        """Layer ``index``'s parameters, counted on the meta model (nothing allocated)."""
        return sum(p.numel() for p in self.defs[index].build(self.meta).parameters())

    def zero3_weights(self, persistence_threshold: int) -> Zero3Weights:
        """The weights as ZeRO-3 splits them (``model_sizes.zero3_fixed_bytes``), counted on
        the meta model: every layer's once (a tied head is the embedding's), those of at most
        ``persistence_threshold`` elements, and the most one module holds itself."""
        layers = [d.build(self.meta) for i, d in enumerate(self.defs) if self.first_of_tie(i)]
        sizes, largest = {}, 0  # numel by parameter (each once), while ``layers`` holds them
        for module in (m for layer in layers for m in layer.modules()):
            own = {id(p): p.numel() for p in module.parameters(recurse=False)}
            largest = max(largest, sum(own.values()))
            sizes.update(own)
        return Zero3Weights(sum(sizes.values()),
                            sum(n for n in sizes.values() if n <= persistence_threshold),
                            largest)

    @functools.cached_property
    def checkpoint(self) -> Checkpoint:
        return Checkpoint(self.path, self.meta)

    def first_of_tie(self, index: int) -> bool:
        """Whether layer ``index`` is the first user of its weights (a tied head is not)."""
        key = self.defs[index].tied_key
        return key is None or index == min(i for i, d in enumerate(self.defs)
                                           if d.tied_key == key)

    def build_layer(self, index: int, device: torch.device | str = "cpu",
                    dtype: torch.dtype = torch.float32) -> nn.Module:
        """Layer ``index`` with its tensors loaded from the folder (and nothing else), taking
        the optional kernels; its weights frozen where the recipe does not train it."""
        layer = load_layer(self.defs[index].build(self.meta), self.checkpoint, device, dtype)
        layer.requires_grad_(self.modes[index] == "train")
        if self.modes[index] == "lora":
            add_adapters(getattr(layer, layer.repeated), self.recipe.lora, index)
        layer.use_kernels(self.kernels.in_part(layer_part(self.defs[index].name)))
        return layer

    def lora_blocks(self) -> dict[str, list[str]]:
        """Under LoRA, each adapted decoder block's path in the ``transformers`` model and the
        linear layers in it that take adapters (counted on the meta model). Raises ConfigError
        when the targets match no linear layer of any block."""
        lora = self.recipe.lora
        blocks = {}
        for d, mode in zip(self.defs, self.modes):
            if mode == "lora":
                layer = d.build(self.meta)
                blocks[layer.paths[layer.repeated]] = targeted(getattr(layer, layer.repeated),
                                                               lora)
        if lora and not any(blocks.values()):
            raise ConfigError(f"--lora-targets {' '.join(lora.targets)} match no linear layer "
                              f"of {self.path}'s decoder blocks")
        return blocks

    def trained_modules(self) -> list[str]:
        """The paths in the ``transformers`` model of the modules the recipe trains in full
        (PEFT's ``modules_to_save`` beside LoRA's adapters)."""
        return [path for d, mode in zip(self.defs, self.modes) if mode == "train"
                for path in d.build(self.meta).paths.values()]

    def build_all(self, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                  one_per_kind: bool = False) -> list[nn.Module]:
        """Every layer in one process (tests), in order; tied layers are one module, as in a
        single pipeline stage. ``one_per_kind``: the first layer of each kind stands in for the
        others (profiling a model too large for one device: same shapes, same cost)."""
        built: dict[str | int, nn.Module] = {}
        layers = []
        for i, d in enumerate(self.defs):
            key = d.tied_key or (d.kind if one_per_kind else i)
            if key not in built:
                built[key] = self.build_layer(i, device, dtype)
            layers.append(built[key])
        return layers


def rank_model(cfg, device: torch.device | str, sequence_parallel: bool) -> ModelLayers:
    """The layer list a rank of the ``TrainConfig`` ``cfg`` builds on ``device``: its attention
    backend (``cfg.attention``, or the best there: ``choose_backend``) and kernels
    (``Kernels.of``). With ``sequence_parallel`` not flash-attn: ``transformers`` calls it
    itself, where the sequence-parallel exchange wraps the backends vlmshard registers
    (``vlmshard.train.attention.across_sequence``); torch's varlen kernel instead."""
    backend = choose_backend(device, cfg.dtype, cfg.attention)
    if sequence_parallel and backend == "flash":
        if cfg.attention == "flash":
            raise ConfigError("attention: flash cannot attend over a sequence-parallel "
                              "share (transformers calls flash-attn itself); varlen instead")
        backend = "varlen"
    return model_layers(cfg.model, backend, Kernels.of(cfg), cfg.recipe)


@functools.cache
def model_layers(path: str, backend: str = "sdpa", kernels: Kernels = Kernels(),
                 recipe: Recipe = Recipe()) -> ModelLayers:
    """The layer list of the model folder ``path`` trained as ``recipe`` says (cached per
    process)."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    folder = read_model_folder(path)
    family = family_for_model_type(folder.config.get("model_type", ""), path)
    if family.bidirectional_images and not supports_runs(backend):
        log.info("%s attends to each image both ways, which %s cannot: torch's varlen kernel "
                 "instead", family.description, backend)
        backend = "varlen"  # the same devices and dtypes as flash-attn
    module, _, function = family.trainer_layers.partition(":")
    layers = getattr(importlib.import_module(module), function)  # may register with transformers
    config = AutoConfig.from_pretrained(folder.path, local_files_only=True)
    with torch.device("meta"):
        meta = AutoModelForImageTextToText.from_config(
            config, attn_implementation=implementation(backend))
    defs, geometry = layers(meta)  # outside meta: rotary tables are real
    return ModelLayers(folder.path, family.name, backend, meta.config, meta, defs, geometry,
                       kernels, recipe)
