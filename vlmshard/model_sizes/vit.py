"""The ViT's layers, per tile: the patch embedding and a block (attention within the tile, or for
Qwen's ViTs across each image or window, added per block by ``image_attention``)."""

from __future__ import annotations

from .configs import ModelConfig, VisionConfig
from .memory import FP32, INT64, Saves, layer_norm_kept, rms_norm_kept
from .work import LayerWork, CostTerms

# A learned position table resampled to each image (Qwen3-VL's bilinear interpolation): what it
# keeps per patch, its four neighbours' int64 indices and fp32 weights (held to the saved-tensor
# hooks by tests/test_model.py)
RESAMPLED_POSITIONS_KEPT = 4 * INT64 + 4 * FP32
# Hidden-wide rows per patch, in the run's dtype, the embedding's backward holds (no gradient
# reaches the pixels): the output and its gradient, a copy reordered (Qwen2.5's windows) and its
# gradient, the conv's workspace; with a resampled position table, its four neighbours' rows, their
# weighted sum and their gradients too (bounds held at or above torch's memory tracker by
# tests/test_model.py)
EMBED_TRANSIENT_ROWS = 6
RESAMPLED_POSITIONS_TRANSIENT_ROWS = 16


def vit_norm_kept(v: VisionConfig, a: int, fused: bool = False) -> float:
    """Bytes one of the ViT's norms keeps per patch (``fused``: an RMSNorm, Liger's)."""
    return (rms_norm_kept(v.hidden, a, fused=fused) if v.rms_norm
            else layer_norm_kept(v.hidden, a))


def vit_norm_params(v: VisionConfig) -> int:
    """Parameters per channel of one of the ViT's norms: an RMSNorm's weight, a LayerNorm's
    weight and bias."""
    return 1 if v.rms_norm else 2


def vit_embed(config: ModelConfig, saves: Saves) -> LayerWork:
    """The patch embedding (a conv over ``temporal_patch`` frames), the learned position table
    (one row per patch of a tile, or a table resampled to each image) and a class token. The
    conv keeps its pixels; a resampled table its neighbours' indices and weights."""
    v, a, patches = config.vision, saves.element_bytes, config.patches_per_tile
    patch_in = 3 * v.temporal_patch * v.patch_size ** 2
    positions = patches if v.position_embeddings < 0 else v.position_embeddings
    resampled = v.position_embeddings > 0
    params = (patch_in * v.hidden + v.patch_bias * v.hidden + positions * v.hidden
              + v.cls_token * (2 if v.position_embeddings < 0 else 1) * v.hidden)
    return LayerWork(
        "vit_embed", params,
        flops=CostTerms(tiles=2 * patch_in * v.hidden * patches),
        activation_bytes=CostTerms(tiles=patches * (a * patch_in
                                               + RESAMPLED_POSITIONS_KEPT * resampled)),
        output_bytes=CostTerms(tiles=a * patches * v.hidden),
        transient_bytes=CostTerms(tiles=patches * a * v.hidden * (
            EMBED_TRANSIENT_ROWS + RESAMPLED_POSITIONS_TRANSIENT_ROWS * resampled)),
        input_is_data=True)


def vit_block(config: ModelConfig, saves: Saves) -> LayerWork:
    """A ViT block, per tile: attention (q, k, v, o) and an MLP (gelu, or SwiGLU with
    ``gated_mlp``), two norms, layer scales where the ViT has them. Its attention's FLOPs are
    here only for a ViT attending within a tile: q·kᵀ and its product with v, 2·P²·hidden each
    for the P patches of a tile (Qwen's: ``image_attention``, per block)."""
    v, a, patches = config.vision, saves.element_bytes, config.patches_per_tile
    mlp = int(v.hidden * v.mlp_ratio)
    matrices = 3 if v.gated_mlp else 2
    linear = 4 * v.hidden ** 2 + matrices * v.hidden * mlp
    # + biases (q, k, v, o; the MLP's), two norms and the layer scales
    params = (linear + (3 * v.qkv_bias + 2) * v.hidden + (matrices - 1) * mlp
              + 2 * vit_norm_params(v) * v.hidden + 2 * v.layer_scale * v.hidden)
    # Keeps per patch: two norms and their outputs (the projections' inputs); q, k, v, the
    # kernel's output and log-sum-exp (Qwen's: q and k rotated, the fp32 rotary tables, and
    # split per image the fused qkv output and the images' outputs concatenated for the
    # projection, in one varlen call a copy of v: ``Saves.vit_one_call``); the layer scales'
    # inputs; the MLP's hiddens (gelu: fc1's output and its activation; quick_gelu a sigmoid
    # more; SwiGLU gate, up, activation and product, Liger's without the activation).
    if v.fused_qkv:
        rotary = 2 * FP32 * v.hidden // v.heads
        attention = a * v.hidden * (4 if saves.vit_one_call else 7) + rotary
    else:
        attention = 4 * a * v.hidden
    hiddens = (3 if saves.liger_vit else 4) if v.gated_mlp else 3 if v.quick_gelu else 2
    kept = (2 * vit_norm_kept(v, a, saves.liger_vit) + 2 * a * v.hidden + attention
            + FP32 * v.heads + 2 * a * v.hidden * v.layer_scale + hiddens * a * mlp)
    # backward: output, its gradient, the input's, a norm's fp32 gradients, and the wider of
    # the MLP's hidden gradients and attention's (fp32 dq accumulator, dq, dk, dv)
    transient = patches * (3 * a * v.hidden + 2 * FP32 * v.hidden + max(
        (hiddens + 1) * a * mlp, FP32 * v.hidden + 3 * a * v.hidden))
    return LayerWork(
        "vit_block", params,
        flops=CostTerms(tiles=2 * patches * linear
                   + (0 if v.fused_qkv else 4 * patches ** 2 * v.hidden)),
        activation_bytes=CostTerms(tiles=patches * kept),
        output_bytes=CostTerms(tiles=a * patches * v.hidden),
        transient_bytes=CostTerms(tiles=transient),
        # q, k, v; the kernel's output and log-sum-exp; the projection; the MLP's first matmul
        # (two, gated) and its second
        selective_bytes=CostTerms(tiles=patches * (a * 6 * v.hidden + FP32 * v.heads
                                              + (1 + v.gated_mlp) * a * mlp)))


def image_attention(v: VisionConfig, block: int) -> CostTerms:
    """A ViT block's attention across images or windows (Qwen's), per unit of their squares
    (``vit_attention_size``): q·kᵀ and its product with v; none for a ViT attending within a
    tile."""
    if not v.fused_qkv:
        return CostTerms()
    windowed = v.window and block not in v.full_blocks
    return CostTerms(vit_windows=4 * v.hidden) if windowed else CostTerms(vit_squares=4 * v.hidden)
