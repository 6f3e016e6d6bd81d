"""Qwen3-VL and Qwen3-VL-MoE (``Qwen3VLForConditionalGeneration``, ``Qwen3VLMoe...``), and
Qwen3.5 and Qwen3.5-MoE (``Qwen3_5ForConditionalGeneration``, ``Qwen3_5Moe...``) as pipeline
layers, over Qwen2-VL's ViT layers (same patches, rotary positions and merger).

What Qwen3-VL adds, each as its own model does it:

- the patch embedding adds a learned position table, bilinearly resampled to each image's patch
  grid (``transformers.vision_utils.get_vision_interpolation_indices_and_weights``);
- **DeepStack**: after each ViT block of ``deepstack_visual_indexes``, a merger of its own turns
  that block's output into one more set of image features; LLM layer k adds set k to its output
  at the image tokens. The sets travel with the micro-batch (``Micro.carry``, on the wire
  between stages, padded to the image-token cap) from the block that makes them to the LLM layer
  that adds them, so any partition is valid and gradients reach the ViT through both paths;
- decoder layers of Qwen3 (q/k norms) or Qwen3-MoE (routed experts), run by ``transformers``;
  when the config asks for the router's auxiliary loss (``output_router_logits``), each MoE
  layer adds its router statistics to sums carried like the DeepStack features, and the head
  adds ``router_aux_loss_coef`` × the loss ``load_balancing_loss_func`` makes of them.

Qwen3.5 is Qwen3-VL's ViT without DeepStack, and an LLM whose layers are mostly Gated DeltaNet
(linear attention, ``linear_attention``: each packed sample's conv window and recurrent state
start fresh) with a gated full-attention layer every few (``config.text_config.layer_types``),
which attends within each sample as every family's does.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import torch
from torch import nn
from transformers.vision_utils import get_vision_interpolation_indices_and_weights

from ..attention import from_host
from ..micro import LayerOutput, Micro, Phase
from .layers import (
    DecoderLayer,
    Detached,
    Geometry,
    LayerDef,
    LMHead,
    language_layers,
    visual_mask,
    visual_token_ids,
)
from .linear_attention import is_linear_attention, linear_attention_block
from .qwen2vl import VISION, Merger, VisionBlock, VisionEmbedding, VisionGeometry


class PositionedEmbedding(VisionEmbedding):
    """Patch embedding + the learned position table resampled to each image's grid."""

    def __init__(self, model: nn.Module, geometry: VisionGeometry) -> None:
        super().__init__(model, geometry)
        vision = model.get_submodule(VISION)
        self.adopt(model, "pos_embed", f"{VISION}.pos_embed")
        self.side = vision.num_grid_per_side
        self.mode = vision.interpolation_mode
        self.align_corners = vision.interpolation_align_corners

    def forward(self, micro: Micro) -> torch.Tensor:
        hidden = super().forward(micro)
        indices, weights = micro.cached("vision_positions", lambda: tuple(
            from_host(t, hidden.device) for t in get_vision_interpolation_indices_and_weights(
                self.geometry.meta(micro).grids, self.side, mode=self.mode,
                align_corners=self.align_corners, spatial_merge_size=self.geometry.merge)))
        positions = (self.pos_embed(indices) * weights[:, :, None]).sum(1)  # as the model
        return hidden + positions.to(hidden.dtype)


class DeepStackBlock(VisionBlock):
    """A ViT block whose output a DeepStack merger also reads: the merged features join the end
    of the carried levels (levels are made and used in the same order)."""

    def __init__(self, model: nn.Module, index: int, level: int,
                 geometry: VisionGeometry) -> None:
        super().__init__(model, index, geometry)
        self.adopt(model, "deepstack", f"{VISION}.deepstack_merger_list.{level}")

    def forward(self, micro: Micro) -> LayerOutput:
        hidden = super().forward(micro)
        level = self.deepstack(hidden)[None]
        pending = micro.carry.get("deepstack")
        if pending is not None:
            level = torch.cat([pending, level.to(pending.dtype)])
        return LayerOutput(hidden, {**micro.carry, "deepstack": level})


class Qwen3DecoderLayer(DecoderLayer):
    """A decoder layer of Qwen3-VL's or Qwen3.5's LLM. ``deepstack``: it then adds the first
    pending DeepStack level at the image tokens, as ``Qwen3VLTextModel`` does after its first
    layers. ``routed``: a MoE layer whose router statistics join the carried sums, as
    ``load_balancing_loss_func`` accumulates them over the layers (when the config asks for the
    auxiliary loss). A Qwen3.5 linear-attention layer keeps each packed sample's conv window and
    recurrent state apart (``linear_attention``)."""

    def __init__(self, model: nn.Module, path: str, rotary, visual_ids: tuple[int, ...],
                 deepstack: bool, routed: bool) -> None:
        super().__init__(model, path, rotary)
        self.visual_ids = visual_ids
        self.deepstack = deepstack
        self.routed = routed
        self.linear = is_linear_attention(self.layer)
        if routed:
            self.top_k = self.layer.mlp.gate.top_k
            self.layer.mlp.gate.register_forward_hook(self._keep_logits)

    def _keep_logits(self, module, args, out) -> None:
        self._logits = out[0]

    def decode(self, micro: Micro) -> torch.Tensor:
        return linear_attention_block(self.layer, micro) if self.linear else super().decode(micro)

    def forward(self, micro: Micro) -> LayerOutput:
        hidden = self.decode(micro)
        carry = dict(micro.carry)
        if self.deepstack:
            levels = carry.pop("deepstack", None)
            if levels is None:
                raise ValueError("a DeepStack layer got no DeepStack features: the ViT blocks "
                                 "that make them did not run before it")
            # the image rows, their count known on the host: no read back of the mask
            rows = torch.nonzero_static(visual_mask(micro.input_ids, self.visual_ids),
                                        size=micro.host.image_tokens).flatten()
            # (a blank tile's rows, past the image tokens, go nowhere: ``HostMeta.blank``)
            hidden = hidden.index_add(0, rows, levels[0, :micro.host.image_tokens].to(hidden.dtype))
            if levels.shape[0] > 1:
                carry["deepstack"] = levels[1:]
        if self.routed:
            logits, self._logits = self._logits, None
            stats = router_stats(logits, self.top_k)
            carry["router"] = stats + carry["router"] if "router" in carry else stats
        return LayerOutput(hidden, carry)


def router_stats(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """[2, experts] for one layer's router logits [tokens, experts]: how often each expert is in
    a token's top k, and the sum of its routing probabilities (float32), computed as
    ``load_balancing_loss_func`` does (``histc``: no read back to the host)."""
    experts = logits.shape[-1]
    weights = torch.softmax(logits, dim=-1)
    _, chosen = torch.topk(weights, top_k, dim=-1)
    counting = torch.float32 if logits.device.type in ("cpu", "mps") else torch.int32
    counts = torch.histc(chosen.reshape(-1).to(counting), bins=experts, min=0, max=experts)
    return torch.stack([counts.float(), weights.float().sum(0)])


class AuxLossHead(LMHead):
    """The LM head of a MoE model trained with the router's auxiliary loss: [summed next-token
    loss, coef × aux] (``AveTokenLoss`` scales the first by the step's tokens), aux from the
    router sums of the ``layers`` MoE layers over this micro-batch's tokens."""

    def __init__(self, model: nn.Module, path: str, layers: int, coef: float) -> None:
        super().__init__(model, path)
        self.layers = layers
        self.coef = coef

    def forward(self, micro: Micro) -> torch.Tensor:
        rows = self.layers * micro.host.tokens
        counts, probs = micro.carry["router"] / rows
        aux = (counts * probs).sum() * counts.shape[0]
        return torch.stack([super().forward(micro), self.coef * aux])


def layers(model: nn.Module) -> tuple[list[LayerDef], Geometry]:
    geometry = VisionGeometry(model)
    vision = model.get_submodule(VISION)
    levels = {block: level for level, block in
              enumerate(getattr(vision, "deepstack_visual_indexes", ()))}  # none in Qwen3.5
    patches = Phase("vision", geometry.merge ** 2)
    defs = [LayerDef("vit_embed", functools.partial(PositionedEmbedding, geometry=geometry),
                     patches)]
    for i in range(len(vision.blocks)):
        if i in levels:
            build = functools.partial(DeepStackBlock, index=i, level=levels[i], geometry=geometry)
        else:
            build = functools.partial(VisionBlock, index=i, geometry=geometry)
        defs.append(LayerDef(f"vit_block_{i}", build, patches,
                             variant="deepstack" if i in levels else ""))
    defs.append(LayerDef("projector", functools.partial(Merger, geometry=geometry),
                         Phase("features", 1)))
    lm = "model.language_model"
    text = model.config.text_config
    rotary = Detached(type(model.get_submodule(f"{lm}.rotary_emb"))(
        model.get_submodule(f"{lm}.rotary_emb").config))
    blocks = model.get_submodule(f"{lm}.layers")
    moe = [hasattr(block.mlp, "gate") for block in blocks]
    linear = [is_linear_attention(block) for block in blocks]
    routed = [m and bool(getattr(text, "output_router_logits", False)) for m in moe]

    def decoder(index: int):
        kind = "_".join(k for k, on in (("linear", linear[index]),
                                        ("deepstack", index < len(levels)),
                                        ("moe", moe[index])) if on)
        return functools.partial(Qwen3DecoderLayer, visual_ids=visual_token_ids(model.config),
                                 deepstack=index < len(levels), routed=routed[index]), kind

    defs += language_layers(model, lm, visual_token_ids(model.config), rotary, decoder)
    if any(routed):
        defs[-1] = replace(defs[-1], build=functools.partial(
            AuxLossHead, path="lm_head", layers=sum(routed), coef=text.router_aux_loss_coef))
    return defs, Geometry(pixel_rows_per_tile=geometry.merge ** 2, tokens_per_tile=1,
                          blank_grid=(1, geometry.merge, geometry.merge))
