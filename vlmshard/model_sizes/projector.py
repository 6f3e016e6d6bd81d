"""The projector between the ViT and the LLM, by kind (``PROJECTORS``), and the pipeline layer
holding it with the token embedding (``projector_merge``): the image tokens' features are
merged into the embedded text there."""

from __future__ import annotations

from dataclasses import dataclass

from .configs import ModelConfig
from .embedding import media_exchange, token_embedding
from .memory import Saves, layer_norm_kept, rms_norm_backward, rms_norm_kept
from .vit import vit_norm_kept, vit_norm_params
from .work import LayerWork, CostTerms


@dataclass(frozen=True)
class ProjectorWork:
    """A projector per tile: its matrices' multiply-adds per image token, its parameters, and
    the bytes it keeps for backward."""

    linear: float
    params: float
    kept: float


def mlp_projector(c: ModelConfig, saves: Saves) -> ProjectorWork:
    """The ViT's final LayerNorm where it has one (``VisionConfig.final_norm``: over each patch
    and the class token), then the pixel shuffle, whose copies keep nothing, and InternVL's
    ``multi_modal_projector``: a LayerNorm of the shuffled width, width -> hidden, GELU,
    hidden -> hidden. Keeps per image token the LayerNorm (its input, the shuffled features),
    its output (the first matrix's input), the GELU's input and its output (the second
    matrix's input)."""
    v, width, hidden, a = c.vision, c.shuffled_width, c.llm.hidden, saves.element_bytes
    linear = width * hidden + hidden ** 2
    final_rows = (c.patches_per_tile + v.cls_token) * v.final_norm
    return ProjectorWork(linear, linear + 2 * width + 2 * hidden + 2 * v.hidden * v.final_norm,
                         final_rows * layer_norm_kept(v.hidden, a)
                         + c.tokens_per_tile * (layer_norm_kept(width, a) + a * width
                                                + 2 * a * hidden))


def merger_projector(c: ModelConfig, saves: Saves) -> ProjectorWork:
    """A norm of each patch (Liger's, ``Saves.liger_projector``), width -> width -> hidden
    (Qwen's PatchMerger; a DeepStack merger norms the width instead)."""
    v, width, a = c.vision, c.shuffled_width, saves.element_bytes
    linear = width * width + width * c.llm.hidden
    return ProjectorWork(linear, linear + vit_norm_params(v) * v.hidden + width + c.llm.hidden,
                         c.patches_per_tile * vit_norm_kept(v, a, saves.liger_projector)
                         + c.tokens_per_tile * 3 * a * width)


def pool_projector(c: ModelConfig, saves: Saves) -> ProjectorWork:
    """The ViT's final norm, an average over each token's patches, an RMSNorm and one matrix
    Hv -> hidden (Gemma 3's projector)."""
    v, a = c.vision, saves.element_bytes
    linear = v.hidden * c.llm.hidden
    return ProjectorWork(linear, linear + 2 * v.hidden + v.hidden,
                         c.patches_per_tile * (layer_norm_kept(v.hidden, a) + a * v.hidden)
                         + c.tokens_per_tile * (rms_norm_kept(v.hidden, a, offset=True)
                                                + a * v.hidden))


# the builder of each projector kind a ``ModelConfig`` names (``PROJECTOR_KINDS``), for the
# kernels and dtype of ``Saves``
PROJECTORS = {"mlp": mlp_projector, "merger": merger_projector, "pool": pool_projector}


def projector_merge(config: ModelConfig, saves: Saves) -> LayerWork:
    """The projector of each tile and the token embedding: the image tokens' features written
    into the embedded text. Its backward holds per patch three rows of the ViT's width (and an
    RMSNorm's fp32 gradients), per image token three of the shuffled width and two of the
    LLM's hidden, and the lookup's fp32 table gradient; on a sequence-parallel rank, the media
    exchange's buffers between them (``media_exchange``)."""
    v, t, a = config.vision, config.llm, saves.element_bytes
    patches, tokens, width = config.patches_per_tile, config.tokens_per_tile, config.shuffled_width
    projector = PROJECTORS[config.projector](config, saves)
    lookup = token_embedding(config, saves)
    return LayerWork(
        "projector_merge", projector.params + lookup.params,
        flops=CostTerms(tiles=2 * tokens * projector.linear),
        activation_bytes=CostTerms(tiles=projector.kept + lookup.activation_bytes.tiles,
                              tokens=lookup.activation_bytes.tokens),
        output_bytes=CostTerms(tokens=a * t.hidden),
        transient_bytes=CostTerms(tiles=patches * (3 * a * v.hidden + rms_norm_backward(v.hidden)
                                              * v.rms_norm)
                             + tokens * (3 * a * width + 2 * a * t.hidden))
        + media_exchange(config, saves)[1],
        fixed_transient_bytes=lookup.fixed_transient_bytes, tied_params=lookup.tied_params)
