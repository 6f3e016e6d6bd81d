"""The LLM's decoder blocks: each a token mixer (attention, sliding attention or linear attention)
and a channel mixer (a dense MLP or a MoE layer), with their norms, as the layer's kind says."""

from __future__ import annotations

from .attention import attention, sliding_attention
from .configs import LLMConfig
from .linear_attention import gated_deltanet
from .memory import Saves, normalized_kept, rms_norm_backward, rms_norm_kept
from .mlp import dense_mlp
from .moe import moe
from .work import LayerWork, Mixer, CostTerms


def decoder_blocks(t: LLMConfig, saves: Saves) -> list[LayerWork]:
    """Every decoder block of ``t`` in order (``llm_block_i``), each layer's mixers by its
    kind (``LLMConfig.is_linear``, ``is_sliding``, ``is_moe``)."""
    full, sliding = attention(t, saves), sliding_attention(t, saves)
    linear, dense, sparse = gated_deltanet(t, saves), dense_mlp(t, saves), moe(t, saves)
    return [decoder_block(f"llm_block_{i}", t, saves, (
        linear if t.is_linear(i) else sliding if t.is_sliding(i) else full,
        sparse if t.is_moe(i) else dense)) for i in range(t.layers)]


def decoder_block(name: str, t: LLMConfig, saves: Saves, mixers: tuple[Mixer, Mixer]
                  ) -> LayerWork:
    """A block of a token and a channel mixer, two norms (four with sandwich norms), handing
    on its hidden. Beside the widest gradients inside a mixer (``Mixer.transient``), its
    backward holds its output, that output's gradient and its input's gradient, and a norm's
    fp32 gradients. Selective recompute applies where both mixers have it."""
    a, offset, fused = saves.element_bytes, t.offset_norms, saves.liger_llm
    norms = 2 + 2 * t.sandwich_norms
    # sandwich norms: their outputs join the residual, nothing else keeps them
    sandwich = (2 * rms_norm_kept(t.hidden, a, offset=offset, fused=fused) if t.sandwich_norms
                else 0)
    selective = (None if any(m.selective is None for m in mixers)
                 else CostTerms(tokens=sum(m.selective for m in mixers)))
    return LayerWork(
        name, params=sum(m.params for m in mixers) + norms * t.hidden,
        flops=CostTerms(tokens=sum(m.flops.tokens for m in mixers),
                   squares=sum(m.flops.squares for m in mixers),
                   windowed=sum(m.flops.windowed for m in mixers)),
        activation_bytes=CostTerms(tokens=sum(m.kept for m in mixers) + sandwich),
        weight_only_bytes=CostTerms(tokens=sum(m.weight_only for m in mixers)
                               + norms * normalized_kept(t.hidden, a, offset, fused)),
        output_bytes=CostTerms(tokens=a * t.hidden),
        transient_bytes=CostTerms(tokens=3 * a * t.hidden + rms_norm_backward(t.hidden)
                             + max(m.transient for m in mixers)),
        selective_bytes=selective)
