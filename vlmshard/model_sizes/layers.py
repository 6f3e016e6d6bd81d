"""The pipeline's layers in order, each costed by its kind's builder (``layer_work``); the same
work under the trainer's layer names (``trainer_layer_work``); and what Ulysses sequence
parallelism can split and sends."""

from __future__ import annotations

from dataclasses import replace

from ..errors import ConfigError
from .configs import LLMConfig, ModelConfig
from .decoder import decoder_blocks
from .deepstack import deepstack_block
from .embedding import token_embedding
from .head import final_norm, head
from .memory import ACTIVATION_BYTES, Saves
from .projector import projector_merge
from .vit import image_attention, vit_block, vit_embed
from .work import LayerWork, CostTerms


def layer_work(config: ModelConfig, saves: Saves = Saves()) -> list[LayerWork]:
    """Every pipeline layer of ``config``, in pipeline order (``config.layer_names()``), keeping
    for backward what the kernels ``saves`` describes keep."""
    return [vit_embed(config, saves), *vit_blocks(config, saves), projector_merge(config, saves),
            *decoder_blocks(config.llm, saves), head(config.llm, saves)]


def vit_blocks(config: ModelConfig, saves: Saves) -> list[LayerWork]:
    """Every ViT block in order (``vit_block_i``): plain, or DeepStack where a merger reads it,
    with its attention across images or windows (``image_attention``)."""
    v, plain = config.vision, vit_block(config, saves)
    stacked = deepstack_block(config, plain, saves)
    blocks = []
    for i in range(v.layers):
        block = stacked if i in v.deepstack else plain
        blocks.append(replace(block, name=f"vit_block_{i}",
                              flops=block.flops + image_attention(v, i)))
    return blocks


# The trainer's pipeline layers (vlmshard.train) that the analytic model names otherwise, and
# those it counts as no layer of their own: the token embedding is a lookup (its table and
# what it keeps are projector_merge's), the final norm a rounding error in FLOPs (its weight
# and what it keeps are the head's).
TRAINER_NAMES = {"projector": "projector_merge"}
NO_LAYER_WORK = ("embed_tokens", "final_norm")


def trainer_layer_work(names: list[str], config: ModelConfig,
                       saves: Saves = Saves()) -> list[LayerWork]:
    """Per trainer layer ``names`` (in pipeline order) its analytic work, each analytic layer
    given to exactly one of them. The token embedding holds its table (taken off the
    projector's parameters), the final norm its weight (off the head's); both pass the hidden
    states on with no FLOPs counted. Raises ConfigError when the names do not cover the analytic
    layers once each. ``saves``: as ``layer_work``'s."""
    work = layer_work(config, saves)
    index = {w.name: i for i, w in enumerate(work)}
    moved = {"embed_tokens": ("projector_merge",
                              token_embedding(config, saves)),
             "final_norm": ("head", final_norm(config.llm, saves))}
    out, used = [], []
    for name in names:
        if name in NO_LAYER_WORK:
            out.append(moved[name][1])
            continue
        row = index.get(TRAINER_NAMES.get(name, name))
        if row is None:
            raise ConfigError(f"layer {name!r} has no counterpart in the analytic model of "
                              f"{config.name} ({', '.join(index)})")
        used.append(row)
        out.append(work[row])
    if sorted(used) != list(range(len(work))):
        raise ConfigError(f"the layers {', '.join(names)} do not cover {config.name}'s analytic "
                          f"layers once each ({', '.join(index)})")
    analytic = [TRAINER_NAMES.get(n, n) for n in names]
    for name in NO_LAYER_WORK:
        if name in names:
            holder, own = moved[name]
            i = analytic.index(holder)
            held, kept = out[i].activation_bytes, own.activation_bytes
            out[i] = replace(out[i], params=out[i].params - own.params,
                             tied_params=out[i].tied_params - own.tied_params,
                             activation_bytes=CostTerms(held.tiles - kept.tiles,
                                                   held.tokens - kept.tokens))
    return out


def sequence_parallel_refusal(llm: LLMConfig, sp: int) -> str | None:
    """Why Ulysses sequence parallelism of degree ``sp`` cannot split this LLM, or None: it
    splits the query heads over the ranks, and the key/value heads (each repeated to ``sp``
    where fewer, so ``sp`` must then be a multiple of them); a linear-attention layer's state
    runs along the sequence."""
    if sp == 1:
        return None
    if llm.linear_layers:
        return "its linear-attention layers carry a state along the sequence"
    if llm.heads % sp or (llm.kv_heads % sp and sp % llm.kv_heads):
        return (f"its {llm.heads} query and {llm.kv_heads} key/value heads do not split over "
                f"{sp} ranks (SP must divide the query heads, and divide the key/value heads or "
                f"be a multiple of them)")
    return None


def sequence_parallel_bytes(config: ModelConfig, sp: int = 1) -> float:
    """Bytes one rank sends per token of its shard in a training step of Ulysses sequence
    parallelism of degree ``sp``, before the (s − 1)/s that stays home: each LLM layer's token
    mixer re-shards its q, k, v (from sequence to heads) and its output (back) in the forward,
    and their gradients in the backward, in bf16. Attention moves its query and key/value
    heads, the latter repeated to ``sp`` where fewer (``Exchange.heads_to_sequence``); a
    linear-attention layer its key and value heads likewise."""
    t = config.llm
    per_layer = []
    for layer in range(t.layers):
        if t.is_linear(layer):
            per_layer.append(2 * t.linear_key_heads * t.linear_key_dim
                             + 2 * t.linear_value_heads * t.linear_value_dim)
        else:
            per_layer.append((2 * t.heads + 2 * max(t.kv_heads, sp)) * t.head_size)
    return 2 * ACTIVATION_BYTES * float(sum(per_layer))
