"""LoRA's adapters on the LLM's decoder blocks: their parameters, FLOPs and what they keep, shaped
as PEFT adds them to each targeted linear layer of the ``transformers`` module."""

from __future__ import annotations

from dataclasses import replace

from ..recipe import Lora
from .configs import LLMConfig, ModelConfig
from .memory import Saves
from .work import LayerWork, CostTerms


def lora_adapter_params(t: LLMConfig, layer: int, lora: Lora) -> int:
    """The parameters of LoRA's adapters on decoder layer ``layer``: rank × (in + out) for each
    targeted linear layer (``recipe.LORA_TARGETS``) the layer has, shaped as its
    ``transformers`` module is: attention's projections (Qwen3.5's q_proj also makes its output
    gate), a dense MLP's or a MoE layer's shared expert's; not a linear-attention token mixer
    nor routed experts."""
    return lora.rank * sum(i + o for i, o in _lora_shapes(t, layer, lora))


def _lora_shapes(t: LLMConfig, layer: int, lora: Lora) -> list[tuple[int, int]]:
    """(in, out) of each linear layer of decoder layer ``layer`` LoRA adapts."""
    q, kv = t.heads * t.head_size, t.kv_heads * t.head_size
    shapes = {}
    if not t.is_linear(layer):
        shapes.update(q_proj=(t.hidden, q * (2 if t.attention_gate else 1)),
                      k_proj=(t.hidden, kv), v_proj=(t.hidden, kv), o_proj=(q, t.hidden))
    mlp = t.shared_expert_intermediate if t.is_moe(layer) else t.intermediate
    if mlp:
        shapes.update(gate_proj=(t.hidden, mlp), up_proj=(t.hidden, mlp),
                      down_proj=(mlp, t.hidden))
    return [shape for name, shape in shapes.items() if name in lora.targets]


def lora_selective_bytes(t: LLMConfig, layer: int, lora: Lora, a: int) -> float:
    """Per token, what LoRA's adapters on decoder layer ``layer`` keep under selective
    recompute: each adapter's two matmul outputs (A's, rank wide; B's, as wide as the layer's
    output); ``a``: an activation element's bytes."""
    return a * sum(lora.rank + out for _, out in _lora_shapes(t, layer, lora))


def lora_kept_bytes(t: LLMConfig, layer: int, lora: Lora, a: int) -> float:
    """Per token, what LoRA's adapters on decoder layer ``layer`` keep with its weights frozen:
    each adapter's input (a targeted layer's input, which the frozen layer no longer keeps:
    the projections' input, a gated attention's output, the MLP's input and down's) and its
    rank-wide hidden (B's input)."""
    targets = set(lora.targets)
    linear, moe = t.is_linear(layer), t.is_moe(layer)
    mlp = t.shared_expert_intermediate if moe else t.intermediate
    named = {} if linear else {"q_proj": "attn_in", "k_proj": "attn_in", "v_proj": "attn_in",
                               "o_proj": "o_in"}
    if mlp:
        named.update(gate_proj="mlp_in", up_proj="mlp_in", down_proj="down_in")
    inputs = {named[n] for n in targets if n in named}
    width = {"attn_in": t.hidden, "mlp_in": t.hidden * (not moe), "down_in": mlp,
             "o_in": t.heads * t.head_size * t.attention_gate}
    return a * sum(width[i] for i in inputs) + a * lora.rank * len(_lora_shapes(t, layer, lora))


def with_adapters(work: list[LayerWork], config: ModelConfig, lora: Lora | None,
                  saves: Saves = Saves()) -> list[LayerWork]:
    """``work`` with LoRA's adapters on each LLM decoder block (none without ``lora``): their
    parameters and their forward FLOPs, a multiply-add per parameter per token, and what they
    keep at the activations' width ``saves`` gives (``layer_work``'s)."""
    a = saves.element_bytes
    if lora is None:
        return work
    out = []
    for w in work:
        if w.name.startswith("llm_block_"):
            layer = int(w.name.rsplit("_", 1)[1])
            n = lora_adapter_params(config.llm, layer, lora)
            # selectively recomputed, an adapter keeps its two matmuls' outputs too
            selective = None if w.selective_bytes is None else w.selective_bytes + CostTerms(
                tokens=lora_selective_bytes(config.llm, layer, lora, a))
            w = replace(w, adapter_params=n, adapter_flops=CostTerms(tokens=2 * n),
                        adapter_kept_bytes=CostTerms(
                            tokens=lora_kept_bytes(config.llm, layer, lora, a)),
                        selective_bytes=selective)
        out.append(w)
    return out
