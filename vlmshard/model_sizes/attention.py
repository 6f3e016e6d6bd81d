"""An LLM layer's attention, full or within a sliding window (Gemma 3's local layers): its token
mixer. Packed samples attend only within themselves, so its quadratic FLOPs follow Σseq_len²
(``CostTerms.squares``) or, sliding, the pairs within the window (``CostTerms.windowed``)."""

from __future__ import annotations

from dataclasses import replace

from .configs import LLMConfig
from .memory import FP32, Saves, kv_kernel_heads, normalized_kept, pre_norm_kept, rms_norm_kept
from .work import Mixer, CostTerms


def attention(t: LLMConfig, saves: Saves) -> Mixer:
    """Causal attention: q (doubled when gated), k, v, o; the scores 2·s²·heads·head_dim per
    sample. Keeps the pre-norm, the q/k norms, the rotary tables, the kernel's q, k, v
    (``Saves.kv_repeated``: k and v as wide as q; a sequence-parallel rank's, repeated to
    ``sp`` heads where fewer: ``kv_kernel_heads``), output and log-sum-exp, o's input (and,
    gated, the gate's sigmoid and the ungated output). A sequence-parallel rank's exchange
    buffers are no part of its peak: its forward exchanges before the layer keeps its MLP's
    tensors, its backward exchanges after the kernel's gradients are made and its kept tensors
    freed (``tests/test_sp_memory.py``)."""
    a, head_dim = saves.element_bytes, t.head_size
    q, kv = t.heads * head_dim, t.kv_heads * head_dim
    kernel_kv = kv_kernel_heads(t.kv_heads, saves) * head_dim
    offset, fused = t.offset_norms, saves.liger_llm
    linear = (2 + t.attention_gate) * t.hidden * q + 2 * t.hidden * kv
    qk_norms = (rms_norm_kept(q, a, t.heads, offset, fused)
                + rms_norm_kept(kv, a, t.kv_heads, offset, fused) if t.qk_norm else 0)
    return Mixer(
        params=linear + (2 * head_dim if t.qk_norm else 0) + (q + 2 * kv) * t.qkv_bias,
        flops=CostTerms(tokens=2 * linear, squares=2 * q),
        kept=(pre_norm_kept(t.hidden, a, offset, fused) + qk_norms + 2 * a * head_dim
              + a * (2 * q + 2 * (q if saves.kv_repeated else kernel_kv)) + FP32 * t.heads
              + a * q * (1 + 2 * t.attention_gate)),
        # the kernel's fp32 dq accumulator and softmax rows, dq, dk, dv; the q/k norms' fp32
        # gradients
        transient=(FP32 * (q + t.heads) + a * (q + 2 * kernel_kv)
                   + 2 * FP32 * (q + kv) * t.qk_norm),
        # q (with its gate), k, v; the kernel's output and log-sum-exp; o
        selective=a * ((1 + t.attention_gate) * q + 2 * kv + q + t.hidden) + FP32 * t.heads,
        # the projections' input; the q/k norms' normalized values; gated, o's input (the
        # gated output: ungated, o reads the kernel's output, which attention keeps anyway)
        weight_only=(a * t.hidden + (normalized_kept(q, a, offset, fused)
                                     + normalized_kept(kv, a, offset, fused)) * t.qk_norm
                     + a * q * t.attention_gate))


def sliding_attention(t: LLMConfig, saves: Saves) -> Mixer:
    """Attention within a sliding window: ``attention``, its quadratic term counting only the
    pairs within the window."""
    full = attention(t, saves)
    return replace(full, flops=CostTerms(tokens=full.flops.tokens, windowed=full.flops.squares))
