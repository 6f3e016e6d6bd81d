"""Gemma 3 (``Gemma3ForConditionalGeneration``) as pipeline layers.

SigLIP runs on each image alone (a batch of 896-px images, full attention within an image, no
mask needed); the projector takes its final norm, average-pools the patch grid to
``mm_tokens_per_image`` (256) soft tokens, norms them and maps them into the LLM, written over
the image's ``<image_soft_token>`` tokens.

The LLM's attention is not "causal within each sample" alone, and each decoder layer says how,
as ``Gemma3Model`` builds its masks (``create_masks_for_vision_model``): an image's soft tokens
see every token of their own image, later ones too (bidirectional runs, ``token_type_ids`` in
``transformers``), and the local layers (``layer_types``: ``sliding_attention``) see only the
``sliding_window`` - 1 keys before each query, with the run's later tokens still visible;
``vlmshard.train.attention`` keeps both within each packed sample. Each layer kind takes its
own rotary table (local and global bases differ). The LM head is the token embedding's weight,
with the final logit soft-capping where the config sets one.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from ..micro import Micro, Phase
from .layers import (
    DecoderLayer,
    Detached,
    Geometry,
    HFLayer,
    LayerDef,
    language_layers,
    visual_token_ids,
)

VISION = "model.vision_tower"
LM = "model.language_model"


class VisionEmbedding(HFLayer):
    def __init__(self, model: nn.Module) -> None:
        super().__init__(model, {"embeddings": f"{VISION}.embeddings"})

    def restored_buffers(self) -> dict:
        """SigLIP's position ids: 0..patches-1, as its embeddings make them."""
        return {"embeddings.position_ids":
                lambda: torch.arange(self.embeddings.num_positions).expand((1, -1))}

    def forward(self, micro: Micro) -> torch.Tensor:
        weight = self.embeddings.patch_embedding.weight
        return self.embeddings(micro.x.to(weight.dtype))


class VisionLayer(HFLayer):
    repeated = "layer"

    def __init__(self, model: nn.Module, index: int) -> None:
        super().__init__(model, {"layer": f"{VISION}.encoder.layers.{index}"})

    def forward(self, micro: Micro) -> torch.Tensor:
        return self.layer(micro.x, attention_mask=None)


class Projector(HFLayer):
    """SigLIP's final norm, then ``Gemma3MultiModalProjector``: [images, patches, Hv] ->
    [images · tokens per image, H]."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model, {"norm": f"{VISION}.post_layernorm",
                                 "projector": "model.multi_modal_projector"})

    def forward(self, micro: Micro) -> torch.Tensor:
        features = self.projector(self.norm(micro.x))
        return features.reshape(-1, features.shape[-1])


class GemmaDecoderLayer(DecoderLayer):
    """A Gemma 3 decoder layer: its kind's rotary table, image runs bidirectional, its window
    (the module passes its own ``sliding_window`` to the attention function)."""

    def __init__(self, model: nn.Module, path: str, rotary) -> None:
        super().__init__(model, path, rotary)
        self.kind = self.layer.self_attn.layer_type

    def decode(self, micro: Micro) -> torch.Tensor:
        positions = micro.position_ids[None]
        rope = micro.cached(f"text_rope_{self.kind}",
                            lambda: self.rotary(micro.x[None], positions, self.kind))
        out = self.layer(micro.x[None], attention_mask=None, position_embeddings=rope,
                         use_cache=False, **micro.text_spans(bidirectional_images=True).kwargs())
        return (out[0] if isinstance(out, tuple) else out)[0]


def layers(model: nn.Module) -> tuple[list[LayerDef], Geometry]:
    config = model.config
    vision = config.vision_config
    if getattr(vision, "vision_use_head", False):
        raise ValueError("a SigLIP with its pooling head (vision_use_head) is not Gemma 3's")
    tile = Phase("vision", 1)
    defs = [LayerDef("vit_embed", VisionEmbedding, tile)]
    defs += [LayerDef(f"vit_block_{i}", functools.partial(VisionLayer, index=i), tile)
             for i in range(vision.num_hidden_layers)]
    defs.append(LayerDef("projector", Projector, Phase("features", config.mm_tokens_per_image)))
    rotary = model.get_submodule(f"{LM}.rotary_emb")
    kinds = config.text_config.layer_types

    def decoder(index: int):
        return GemmaDecoderLayer, "sliding" if kinds[index] == "sliding_attention" else ""

    defs += language_layers(model, LM, visual_token_ids(config),
                            Detached(type(rotary)(rotary.config)), decoder)
    return defs, Geometry(pixel_rows_per_tile=1, tokens_per_tile=config.mm_tokens_per_image)
