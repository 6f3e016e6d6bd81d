"""An LLM layer's dense channel mixer: a SwiGLU MLP (gate, up, down)."""

from __future__ import annotations

from .configs import LLMConfig
from .memory import Saves, gated_mlp_kept, pre_norm_kept
from .work import Mixer, CostTerms


def dense_mlp(t: LLMConfig, saves: Saves) -> Mixer:
    """A SwiGLU MLP of ``intermediate``. Keeps the pre-norm and the gate, up, activation and
    product (Liger's kernel: no activation)."""
    a, fused = saves.element_bytes, saves.liger_llm
    return Mixer(params=3 * t.hidden * t.intermediate,
                 flops=CostTerms(tokens=2 * 3 * t.hidden * t.intermediate),
                 kept=(pre_norm_kept(t.hidden, a, t.offset_norms, fused)
                       + gated_mlp_kept(t.intermediate, a, fused)),
                 transient=3 * a * t.intermediate,
                 selective=a * (2 * t.intermediate + t.hidden),  # gate, up, down
                 weight_only=a * (t.hidden + t.intermediate))  # gate/up's input, down's
