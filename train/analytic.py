"""What each pipeline layer costs, computed from the model's sizes rather than measured.

Real-size models (the ``internvl2-2b`` and ``internvl-chat-1.5`` presets) cannot be profiled on
a CPU, yet the packer's default cost model and the cluster simulator need their per-layer costs.
Every cost here is linear in three sizes of a micro-batch, the same three the packer balances:
Σtiles, Σtokens and Σseq_len² (packed samples attend only within themselves). ``vlmshard train
profile`` measures the same quantities on a real device; this module is its analytic twin.

Conventions: forward FLOPs count a multiply-add as 2 (backward is 2× forward); activations are
bf16 (2 bytes) with memory-efficient attention, so no score matrix is kept; parameters cost
16 bytes each for mixed-precision AdamW (bf16 weight and gradient, fp32 master and two moments).
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import ModelConfig

ACTIVATION_BYTES = 2  # bf16
BYTES_PER_PARAM = 16  # AdamW: bf16 weight and gradient + fp32 master and moments, or all fp32


@dataclass(frozen=True)
class Size:
    """The three sizes of a micro-batch (or a sum of them) that every cost is linear in."""

    tiles: float = 0.0
    tokens: float = 0.0
    squares: float = 0.0  # Σ seq_len² over packed samples

    def dot(self, other: "Size") -> float:
        return self.tiles * other.tiles + self.tokens * other.tokens + self.squares * other.squares


@dataclass(frozen=True)
class LayerWork:
    """One pipeline layer: parameters, and per unit of ``Size`` its forward FLOPs, the activation
    bytes it keeps for backward and the bytes of the activation it hands to the next layer."""

    name: str
    params: int
    flops: Size
    activation_bytes: Size
    output_bytes: Size

    @property
    def vision(self) -> bool:
        """Whether the layer's work scales with tiles (ViT side) rather than tokens (LLM)."""
        return self.flops.tiles > 0


def layer_work(config: ModelConfig) -> list[LayerWork]:
    """Every pipeline layer of ``config``, in pipeline order (``config.layer_names()``)."""
    v, t = config.vision, config.llm
    a = ACTIVATION_BYTES
    patches = (v.image_size // v.patch_size) ** 2  # per tile
    tokens = config.tokens_per_tile  # image tokens per tile after pixel shuffle
    mlp = int(v.hidden * v.mlp_ratio)
    width = int(v.hidden / config.downsample_ratio ** 2)  # pixel-shuffled channels
    head_dim = t.hidden // t.heads
    kv = t.kv_heads * head_dim
    vit_out = Size(tiles=a * patches * v.hidden)
    llm_out = Size(tokens=a * t.hidden)

    embed_params = 3 * v.patch_size ** 2 * v.hidden + v.hidden + patches * v.hidden
    vit_linear = 4 * v.hidden ** 2 + 2 * v.hidden * mlp
    vit_params = vit_linear + 5 * v.hidden + mlp + 4 * v.hidden  # + biases and two norms
    projector_linear = width * t.hidden + t.hidden ** 2
    projector_params = projector_linear + 2 * width + 2 * t.hidden + t.vocab_size * t.hidden
    llm_linear = 2 * t.hidden ** 2 + 2 * t.hidden * kv + 3 * t.hidden * t.intermediate
    llm_params = llm_linear + 2 * t.hidden

    embed = LayerWork(
        "vit_embed", embed_params,
        flops=Size(tiles=2 * 3 * v.patch_size ** 2 * v.hidden * patches),
        activation_bytes=Size(tiles=a * 3 * v.image_size ** 2),  # the conv keeps its pixels
        output_bytes=vit_out)
    # Per patch: two norm inputs and outputs, q/k/v, attention output, the MLP's two hiddens.
    vit_block = dict(
        params=vit_params,
        flops=Size(tiles=2 * patches * vit_linear + 4 * patches ** 2 * v.hidden),
        activation_bytes=Size(tiles=a * patches * (8 * v.hidden + 2 * mlp)),
        output_bytes=vit_out)
    projector = LayerWork(
        "projector_merge", projector_params,
        flops=Size(tiles=2 * tokens * projector_linear),
        activation_bytes=Size(tiles=a * tokens * (2 * width + 2 * t.hidden)),
        output_bytes=llm_out)
    # Per token: hidden and two norm outputs, q/k/v, attention output, the residual sum, the
    # SwiGLU gate, up, activation and product. Causal attention is 2·s²·hidden per sample.
    llm_block = dict(
        params=llm_params,
        flops=Size(tokens=2 * llm_linear, squares=2 * t.hidden),
        activation_bytes=Size(tokens=a * (6 * t.hidden + 2 * kv + 4 * t.intermediate)),
        output_bytes=llm_out)
    head = LayerWork(
        "head", t.hidden * t.vocab_size + t.hidden,
        flops=Size(tokens=2 * t.hidden * t.vocab_size),
        activation_bytes=Size(tokens=a * 2 * t.hidden),  # logits are chunked and recomputed
        output_bytes=Size())

    return ([embed] + [LayerWork(f"vit_block_{i}", **vit_block) for i in range(v.layers)]
              + [projector] + [LayerWork(f"llm_block_{i}", **llm_block) for i in range(t.layers)]
              + [head])


def training_flops(config: ModelConfig) -> Size:
    """Forward + backward FLOPs of the whole model per tile, per token and per squared length:
    the packer's default cost model (``a_v``, ``a_t``, ``b``)."""
    work = layer_work(config)
    return Size(*(3 * sum(getattr(lay.flops, k) for lay in work)
                  for k in ("tiles", "tokens", "squares")))
