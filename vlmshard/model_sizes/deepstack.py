"""A DeepStack ViT block (Qwen3-VL): a block whose output a merger also reads, its features added
to the LLM's hidden states at its first layers."""

from __future__ import annotations

from .configs import ModelConfig
from .memory import Saves, layer_norm_kept
from .projector import PROJECTORS
from .work import LayerWork, CostTerms


def deepstack_block(config: ModelConfig, block: LayerWork, saves: Saves) -> LayerWork:
    """``block`` (``vit.vit_block``), then its merger on its output: the projector's matrices
    with a LayerNorm over the shuffled width instead of each patch. The merger keeps per image
    token the norm, its output, the first matmul's output and its activation, and hands on its
    features beside the block's output."""
    t, a, tokens = config.llm, saves.element_bytes, config.tokens_per_tile
    width = config.shuffled_width
    linear = PROJECTORS[config.projector](config, saves).linear
    merger_params = linear + 2 * width + width + t.hidden
    return LayerWork(
        block.name, block.params + merger_params,
        flops=block.flops + CostTerms(tiles=2 * tokens * linear),
        activation_bytes=CostTerms(tiles=block.activation_bytes.tiles
                              + tokens * (layer_norm_kept(width, a) + 3 * a * width)),
        output_bytes=CostTerms(tiles=block.output_bytes.tiles + a * tokens * t.hidden),
        transient_bytes=CostTerms(tiles=block.transient_bytes.tiles + tokens * 3 * a * width),
        selective_bytes=CostTerms(tiles=block.selective_bytes.tiles
                             + tokens * a * (width + t.hidden)))
