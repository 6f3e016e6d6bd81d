"""An LLM layer's mixture of experts: a router over ``experts`` SwiGLU experts, each token
through ``experts_per_token`` of them (its FLOPs count those; its parameters all of them), and
a gated shared expert where the model has one (Qwen3.5-MoE)."""

from __future__ import annotations

from .configs import LLMConfig
from .memory import FP32, Saves, gated_mlp_kept, pre_norm_kept
from .work import Mixer, CostTerms

# What ``transformers``' expert loop keeps per token and chosen expert beside the expert's own
# activations: the routing's int64 token and top-k positions its gathers and ``index_add_`` keep
# and the routing weight (as tests/test_model.py's saved-tensor hooks count them)
MOE_ROUTING_BYTES = 46


def moe(t: LLMConfig, saves: Saves) -> Mixer:
    """The router and the chosen experts, and the shared expert. Keeps the pre-norm, the
    router's logits and probabilities, and per chosen expert its gathered input, gate/up,
    activation, product and output, with the routing's indices and weight
    (``MOE_ROUTING_BYTES``); the shared expert keeps a gated MLP's, its output and its gate."""
    a, fused, shared_mid = saves.element_bytes, saves.liger_llm, t.shared_expert_intermediate
    shared = 3 * t.hidden * shared_mid + (t.hidden if shared_mid else 0)
    expert = 3 * t.hidden * t.moe_intermediate
    return Mixer(
        params=t.hidden * t.experts + t.experts * expert + shared,
        flops=CostTerms(tokens=2 * (t.hidden * t.experts + t.experts_per_token * expert + shared)),
        kept=(pre_norm_kept(t.hidden, a, t.offset_norms, fused) + (FP32 + a) * t.experts + FP32
              + t.experts_per_token * (2 * a * t.hidden + 4 * a * t.moe_intermediate
                                       + MOE_ROUTING_BYTES)
              + (gated_mlp_kept(shared_mid, a, fused) + a * t.hidden + 2 * a if shared_mid else 0)),
        transient=(FP32 * t.experts + t.experts_per_token * (3 * a * t.moe_intermediate
                                                              + 2 * a * t.hidden)
                   + 3 * a * shared_mid),
        # the router's logits; per chosen expert its gate/up and down; the shared expert's
        selective=(a * t.experts + t.experts_per_token * a * (2 * t.moe_intermediate + t.hidden)
                   + (a * (2 * shared_mid + t.hidden + 1) if shared_mid else 0)),
        # the router's input; per chosen expert its gathered input and down's; the shared
        # expert's down's
        weight_only=(a * t.hidden + t.experts_per_token * a * (t.hidden + t.moe_intermediate)
                     + a * shared_mid))
