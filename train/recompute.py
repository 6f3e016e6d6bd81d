"""How a layer's activations are recomputed in backward: not at all, in ``full`` (the layer keeps
only its input and runs its forward again), or ``selective``.

``selective`` is op-level selective checkpointing (``torch.utils.checkpoint``'s
``create_selective_checkpoint_contexts``, as torchtitan's "op" policy): the outputs of the
matrix multiplies and of the attention kernels are kept, everything between them (norms, rotary
embeddings, activation functions, residual sums, reshapes) is recomputed from them in backward.
With flash attention there is no score matrix whose recompute would pay (what Megatron's
selective recompute drops); what is cheap to recompute is the elementwise work, and it holds
most of a block's bytes: a norm keeps its input in fp32, an MLP its gate, up and activation.
``vlmshard.model_sizes`` costs each mode (``LayerWork.selective_bytes``); the partition search
takes ``selective`` before ``full``, since its recompute costs no matrix FLOPs.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools

import torch
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

# Kept under ``selective``: the ops whose outputs took the FLOPs, as this torch names them
# (matmuls, grouped expert matmuls, SDPA's kernels, the varlen and flash kernels).
_SAVED = [("aten", "mm"), ("aten", "addmm"), ("aten", "bmm"), ("aten", "_grouped_mm"),
          ("aten", "_scaled_dot_product_flash_attention"),
          ("aten", "_scaled_dot_product_flash_attention_for_cpu"),
          ("aten", "_scaled_dot_product_efficient_attention"),
          ("aten", "_scaled_dot_product_cudnn_attention"),
          ("aten", "_flash_attention_forward"), ("aten", "_efficient_attention_forward"),
          ("torch_attn", "_varlen_attn"), ("flash_attn", "_flash_attn_varlen_forward"),
          ("vlmshard", "packed_attention")]  # a compiled block's (``attention.in_graph``)

# How the compiled block running now recomputes itself inside its graph (``run_layer``)
_IN_GRAPH: contextvars.ContextVar[str | None] = contextvars.ContextVar("recompute_in_graph",
                                                                       default=None)


@functools.cache
def saved_ops() -> list:
    """The ops of ``_SAVED`` this torch (and flash-attn, where installed) defines."""
    found = []
    for namespace, name in _SAVED:
        packet = getattr(getattr(torch.ops, namespace, None), name, None)
        if packet is not None:
            found.append(packet.default if hasattr(packet, "default") else packet)
    return found


def recomputed(fn, mode: str | None):
    """``fn`` run under ``torch.utils.checkpoint`` as ``mode`` (``full``, ``selective``, or
    None: not at all) says."""
    if not mode:
        return fn
    # whole recompute passes no context_fn: under torch.compile, checkpoint takes none but
    # selective checkpointing's ("checkpoint not implemented for ... context_fn")
    contexts = ({"context_fn": functools.partial(create_selective_checkpoint_contexts,
                                                 saved_ops())} if mode == "selective" else {})

    def run(*args, **kwargs):
        return checkpoint(fn, *args, use_reentrant=False, **contexts, **kwargs)
    return run


def in_graph_mode() -> str | None:
    """The recompute mode a compiled block takes inside its graph now (``run_layer``)."""
    return _IN_GRAPH.get()


@contextlib.contextmanager
def _in_graph(mode: str):
    token = _IN_GRAPH.set(mode)
    try:
        yield
    finally:
        _IN_GRAPH.reset(token)


def run_layer(layer, micro, mode: str | None, compiled: bool = False):
    """``layer(micro)``, its activations recomputed in backward as ``mode`` says; ``no_grad``:
    a layer with no backward (frozen, nothing trained before it) keeps nothing. ``compiled``:
    the layer's repeated block is compiled (``kernels.compile_block``), and recomputes itself
    inside its graph, torchtitan's order ``compile(checkpoint(block))``: an eager checkpoint
    around compiled code would have Dynamo trace under its dispatch mode (a run stopped in
    Dynamo there), and the compiled graph's own recompute is fused. What the layer does around
    the block (a micro-batch's rotary tables, made once and cached) is then kept."""
    if mode == "no_grad":
        with torch.no_grad():
            return layer(micro)
    if not mode or not torch.is_grad_enabled():
        return layer(micro)
    if compiled:
        with _in_graph(mode):
            return layer(micro)
    return recomputed(layer, mode)(micro)
