"""What a layer costs in each mode a recipe runs it in (``vlmshard.recipe``: a frozen prefix's
forward alone, a frozen layer's input gradient, a trained layer, LoRA's adapters beside frozen
weights), and the whole model's training FLOPs so counted."""

from __future__ import annotations

from ..recipe import Recipe, flops_factor
from .configs import ModelConfig
from .layers import layer_work
from .lora import with_adapters
from .work import TERM_FIELDS, LayerWork, CostTerms


def executed_flops(flops: CostTerms, mode: str) -> CostTerms:
    """Forward + backward FLOPs of a layer of forward ``flops`` run in ``mode``
    (``vlmshard.recipe``): the forward alone for a frozen prefix, the input's gradient beside
    it for a frozen layer after a trained one, the whole backward for a trained layer."""
    return CostTerms(*(flops_factor(mode, k) * getattr(flops, k) for k in TERM_FIELDS))


def kept_bytes(work: LayerWork, mode: str) -> CostTerms:
    """The activation bytes a layer keeps for backward in ``mode`` (``vlmshard.recipe``), per
    unit of ``CostTerms``: none in a frozen prefix; with its weights frozen, less what only their
    gradients read; under LoRA that, plus what the adapters keep."""
    if mode == "forward":
        return CostTerms()
    if mode == "train":
        return work.activation_bytes
    frozen = work.activation_bytes + work.weight_only_bytes.scaled(-1)
    return frozen + work.adapter_kept_bytes if mode == "lora" else frozen


def held_transient(work: LayerWork, mode: str, size: CostTerms) -> float:
    """The transient bytes of a layer in ``mode`` at a micro-batch of ``size``: its
    ``LayerWork.transient``; a frozen prefix, which keeps nothing, holds its forward's tensors
    for a moment instead, at most what it would keep trained."""
    return work.transient(size) + (work.activation_bytes.dot(size) if mode == "forward" else 0)


def layer_training_flops(work: LayerWork, mode: str) -> CostTerms:
    """Forward + backward FLOPs of a layer in ``mode`` (``executed_flops``), its LoRA adapters'
    trained beside it. A layer whose input is data (``LayerWork.input_is_data``: the patch
    embedding's pixels) computes no input gradient: its backward is its weights' alone."""
    flops = executed_flops(work.flops, mode)
    if work.input_is_data and mode != "forward":
        flops = flops + work.flops.scaled(-1)
    return flops + work.adapter_flops.scaled(3)


def forward_flops(work: LayerWork, mode: str) -> CostTerms:
    """The FLOPs a layer's forward runs in ``mode``: its own and its LoRA adapters'; for a
    layer that computes its gradients in its forward (``LayerWork.gradients_in_forward``), all
    its training FLOPs. What a recompute of the layer runs again."""
    if work.gradients_in_forward:
        return layer_training_flops(work, mode)
    return work.flops + work.adapter_flops


def training_flops(config: ModelConfig, recipe: Recipe = Recipe()) -> CostTerms:
    """Forward + backward FLOPs of the whole model per unit of each ``CostTerms``, each layer as
    ``recipe`` runs it (a frozen ViT at the front: its forward alone; LoRA's adapters beside
    their frozen weights): per tile, per token and per squared length the packer's default
    cost model (``a_v``, ``a_t``, ``b``)."""
    modes = recipe.modes(config.layer_names(), tied=config.llm.tied_embeddings)
    work = with_adapters(layer_work(config), config, recipe.lora)
    return sum((layer_training_flops(lay, mode) for lay, mode in zip(work, modes)), CostTerms())
