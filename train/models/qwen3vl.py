"""Qwen3-VL and Qwen3-VL-MoE (``Qwen3VLForConditionalGeneration``, ``Qwen3VLMoe...``) as
pipeline layers, over Qwen2-VL's ViT layers (same patches, rotary positions and merger).

What Qwen3-VL adds, each as its own model does it:

- the patch embedding adds a learned position table, bilinearly resampled to each image's patch
  grid (``transformers.vision_utils.get_vision_interpolation_indices_and_weights``);
- **DeepStack**: after each ViT block of ``deepstack_visual_indexes``, a merger of its own turns
  that block's output into one more set of image features; LLM layer k adds set k to its output
  at the image tokens. The sets travel with the micro-batch (``Micro.carry``, on the wire
  between stages, padded to the image-token cap) from the block that makes them to the LLM layer
  that adds them, so any partition is valid and gradients reach the ViT through both paths;
- decoder layers of Qwen3 (q/k norms) or Qwen3-MoE (routed experts), run by ``transformers``.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from transformers.vision_utils import get_vision_interpolation_indices_and_weights

from ..micro import LayerOutput, Micro, Phase
from .layers import DecoderLayer, Detached, Geometry, LayerDef, language_layers
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
            t.to(hidden.device) for t in get_vision_interpolation_indices_and_weights(
                self.geometry.meta(micro).grids, self.side, mode=self.mode,
                align_corners=self.align_corners, spatial_merge_size=self.geometry.merge)))
        positions = (self.pos_embed(indices) * weights[:, :, None].to(hidden.dtype)).sum(1)
        return hidden + positions.to(hidden.dtype)


class DeepStackBlock(VisionBlock):
    """A ViT block whose output a DeepStack merger also reads: the merged features join the end
    of the carry (levels are made and used in the same order)."""

    def __init__(self, model: nn.Module, index: int, level: int,
                 geometry: VisionGeometry) -> None:
        super().__init__(model, index, geometry)
        self.adopt(model, "deepstack", f"{VISION}.deepstack_merger_list.{level}")

    def forward(self, micro: Micro) -> LayerOutput:
        hidden = super().forward(micro)
        level = self.deepstack(hidden)[None]
        carry = level if micro.carry is None else torch.cat([micro.carry, level.to(
            micro.carry.dtype)])
        return LayerOutput(hidden, carry)


class DeepStackDecoderLayer(DecoderLayer):
    """A decoder layer that then adds the first carried level at the image tokens."""

    def __init__(self, model: nn.Module, path: str, rotary, image_token_id: int) -> None:
        super().__init__(model, path, rotary)
        self.image_token_id = image_token_id

    def forward(self, micro: Micro) -> LayerOutput:
        hidden = super().forward(micro)
        if micro.carry is None:
            raise ValueError("a DeepStack layer got no carried image features: the ViT blocks "
                             "that make them did not run before it")
        # the image rows, their count known on the host: no read back of the mask
        rows = torch.nonzero_static(micro.input_ids == self.image_token_id,
                                    size=micro.host.image_tokens).flatten()
        hidden = hidden.index_add(0, rows, micro.carry[0].to(hidden.dtype))
        rest = micro.carry[1:]
        return LayerOutput(hidden, rest if rest.shape[0] else None)


def layers(model: nn.Module) -> tuple[list[LayerDef], Geometry]:
    geometry = VisionGeometry(model)
    vision = model.get_submodule(VISION)
    levels = {block: level for level, block in enumerate(vision.deepstack_visual_indexes)}
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
    rotary = Detached(type(model.get_submodule(f"{lm}.rotary_emb"))(
        model.get_submodule(f"{lm}.rotary_emb").config))
    image_token_id = model.config.image_token_id

    def decoder(index: int):
        if index < len(levels):
            return functools.partial(DeepStackDecoderLayer, image_token_id=image_token_id), \
                "deepstack"
        return DecoderLayer, ""

    defs += language_layers(model, lm, image_token_id, rotary, decoder)
    return defs, Geometry(pixel_rows_per_tile=geometry.merge ** 2, tokens_per_tile=1)
