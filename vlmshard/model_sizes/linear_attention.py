"""An LLM layer's linear attention (Gated DeltaNet, Qwen3.5): a token mixer with a causal
depthwise conv and a recurrent state per value head, so nothing quadratic in a sample's length.
Its delta rule is costed as ``transformers``' torch kernel (``torch_chunk_gated_delta_rule``)
runs it, in fp32 chunks, which is what a CPU run and tests/test_model.py run."""

from __future__ import annotations

from .configs import LLMConfig
from .memory import FP32, Saves, pre_norm_kept
from .work import Mixer, CostTerms

# The torch kernel's chunk of tokens (its ``chunk_size``)
DELTA_RULE_CHUNK = 64
# Its multiply-adds per token and value head, counted from the kernel: per key channel this
# many times the chunk, per value channel this many times the chunk, per element of the
# dk × dv state this many (a sample rounded up to whole chunks is not counted)
DELTA_RULE_KEY_MACS = 2.5
DELTA_RULE_VALUE_MACS = 1.5
DELTA_RULE_STATE_MACS = 3
# What it keeps per token and value head, in fp32 values (held to the saved-tensor hooks by
# tests/test_model.py): rows as wide as the chunk (the C×C decay, key and query products and
# their solved systems), rows as wide as a key head and as a value head, a few scalars, and
# the dk × dv state of each chunk (per token: that many states over the chunk). Its backward
# holds gradients as wide as the chunk, key and value rows again.
DELTA_RULE_CHUNK_ROWS = 5
DELTA_RULE_KEY_ROWS = 12
DELTA_RULE_VALUE_ROWS = 6
DELTA_RULE_SCALARS = 10
DELTA_RULE_STATES = 2


def gated_deltanet(t: LLMConfig, saves: Saves) -> Mixer:
    """Gated DeltaNet: projections to q/k/v (through the conv), the output gate z, a and b per
    value head; the conv of ``linear_conv_kernel``; the chunked delta rule. Keeps the pre-norm,
    q/k/v before and after the conv, b and a, the delta rule's fp32 chunks, the core output's
    gated norm and z. No selective mode: the chunked kernel has no outputs to keep apart."""
    a, heads = saves.element_bytes, t.linear_value_heads
    key_dim = t.linear_key_heads * t.linear_key_dim
    value_dim = heads * t.linear_value_dim
    conv_dim = 2 * key_dim + value_dim
    linear = t.hidden * (conv_dim + 2 * value_dim + 2 * heads)
    chunk, dk, dv = DELTA_RULE_CHUNK, t.linear_key_dim, t.linear_value_dim
    rows = DELTA_RULE_CHUNK_ROWS * chunk + DELTA_RULE_KEY_ROWS * dk + DELTA_RULE_VALUE_ROWS * dv
    return Mixer(
        params=linear + conv_dim * t.linear_conv_kernel + 2 * heads + dv,
        flops=CostTerms(tokens=2 * linear + 2 * conv_dim * t.linear_conv_kernel
                   + 2 * heads * (DELTA_RULE_KEY_MACS * chunk * dk
                                  + DELTA_RULE_VALUE_MACS * chunk * dv
                                  + DELTA_RULE_STATE_MACS * dk * dv)),
        kept=(pre_norm_kept(t.hidden, a, t.offset_norms, saves.liger_llm) + 2 * a * conv_dim
              + a * heads
              + heads * FP32 * (rows + DELTA_RULE_SCALARS + DELTA_RULE_STATES * dk * dv / chunk)
              + value_dim * (3 * FP32 + 3 * a) + FP32 * heads),
        transient=heads * FP32 * rows,
        # the projections' input, out_proj's, the gated norm's normalized values and gated
        # output, the decay's fp32 step per value head
        weight_only=a * t.hidden + 3 * a * value_dim + FP32 * heads)
