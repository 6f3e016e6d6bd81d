"""InternVL (``InternVLForConditionalGeneration``) as pipeline layers.

InternViT runs on each 448-px tile alone (a batch of tiles, full attention within a tile, no
mask needed); the projector drops the CLS token, pixel-shuffles 2×2 patches into one and maps
them into the LLM: 256 features per tile, written over the tile's ``<IMG_CONTEXT>`` tokens.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from transformers.models.internvl.modeling_internvl import InternVLModel

from vlmshard.errors import InputError

from ..micro import Micro, Phase
from .layers import (
    Detached,
    Geometry,
    HFLayer,
    LayerDef,
    language_layers,
    visual_token_ids,
)

VISION = "model.vision_tower"


class VisionEmbedding(HFLayer):
    def __init__(self, model: nn.Module) -> None:
        super().__init__(model, {"embeddings": f"{VISION}.embeddings"})

    def forward(self, micro: Micro) -> torch.Tensor:
        weight = self.embeddings.patch_embeddings.projection.weight
        return self.embeddings(micro.x.to(weight.dtype))


class VisionLayer(HFLayer):
    repeated = "layer"

    def __init__(self, model: nn.Module, index: int) -> None:
        super().__init__(model, {"layer": f"{VISION}.encoder.layer.{index}"})

    def forward(self, micro: Micro) -> torch.Tensor:
        return self.layer(micro.x)


class Projector(HFLayer):
    """The ViT's final norm, CLS dropped, pixel shuffle, then the MLP projector (as
    ``InternVLModel.get_image_features``): [tiles, 1 + patches, Hv] -> [tiles · 256, H]."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model, {"layernorm": f"{VISION}.layernorm",
                                 "projector": "model.multi_modal_projector"})
        config = model.config
        self.ratio = config.downsample_ratio
        self.drop_cls = config.vision_feature_select_strategy == "default"

    def forward(self, micro: Micro) -> torch.Tensor:
        features = self.layernorm(micro.x)
        if self.drop_cls:
            features = features[:, 1:]
        tiles, patches, width = features.shape
        side = int(patches ** 0.5)
        features = InternVLModel.pixel_shuffle(None, features.reshape(tiles, side, side, width),
                                               scale_factor=self.ratio)
        features = self.projector(features.reshape(tiles, features.shape[1] * features.shape[2],
                                                   features.shape[-1]))
        return features.reshape(-1, features.shape[-1])


def layers(model: nn.Module) -> tuple[list[LayerDef], Geometry]:
    config = model.config
    if config.vision_feature_layer != -1:
        raise InputError(f"vision_feature_layer {config.vision_feature_layer}: only the last "
                         "ViT layer's features (-1) are supported")
    vision = config.vision_config
    side = vision.image_size[0] // vision.patch_size[0]
    tokens_per_tile = int(side * config.downsample_ratio) ** 2
    tile = Phase("vision", 1)
    defs = [LayerDef("vit_embed", VisionEmbedding, tile)]
    defs += [LayerDef(f"vit_block_{i}", functools.partial(VisionLayer, index=i), tile)
             for i in range(vision.num_hidden_layers)]
    defs.append(LayerDef("projector", Projector, Phase("features", tokens_per_tile)))
    rotary = model.get_submodule("model.language_model.rotary_emb")
    defs += language_layers(model, "model.language_model", visual_token_ids(config),
                            Detached(type(rotary)(rotary.config)))
    return defs, Geometry(pixel_rows_per_tile=1, tokens_per_tile=tokens_per_tile)
