"""Linear-attention decoder layers on packed samples: Qwen3.5's Gated DeltaNet.

A Gated DeltaNet layer mixes tokens through a short causal depthwise conv1d and a recurrent
state carried token to token; neither knows about packing. Run over a packed micro-batch as one
sequence, the conv window and the state of one sample would flow into the next. Each packed
sample must start with an empty window and a zero state, as it does when the model sees it
alone. Two ways keep them apart, both running ``transformers``' own module:

- **each sample alone** (every device): the token mixer (``linear_attn``) on each sample's slice
  of the packed hidden states; the per-token parts of the layer (norms, MLP or experts) still
  run once over the whole micro-batch;
- **varlen kernels** (CUDA, where ``flash-linear-attention`` and ``causal-conv1d`` are
  installed): the mixer once over the micro-batch, given the boundaries as
  ``transformers`` passes them on to those kernels: ``cu_seq_lens_q`` to the chunked delta rule
  (its ``cu_seqlens``) and ``seq_idx`` (each token's sample) to the conv.

The decoder layer's body around the mixer is ``Qwen3_5DecoderLayer.forward``'s linear-attention
branch (pre-norm, mixer, residual; post-norm, MLP, residual); ``tests/test_model.py`` checks
the result against the ``transformers`` model run on each sample alone.
"""

from __future__ import annotations

import functools
import importlib.util

import torch
from torch import nn

from ..attention import from_host
from ..micro import Micro

FAST_KERNELS = ("fla", "causal_conv1d")  # flash-linear-attention, causal-conv1d


@functools.cache
def _kernels_installed() -> bool:
    return all(importlib.util.find_spec(m) for m in FAST_KERNELS)


def varlen_kernels(device: torch.device) -> bool:
    """Whether the mixer can take the whole micro-batch with its boundaries on ``device``
    (asked per layer and micro-batch: the package lookup is done once)."""
    return device.type == "cuda" and _kernels_installed()


def is_linear_attention(block: nn.Module) -> bool:
    """Whether a ``transformers`` decoder layer mixes tokens by linear attention."""
    return getattr(block, "block_type", "") == "linear_attention"


def mix_packed(mixer: nn.Module, hidden: torch.Tensor, micro: Micro) -> torch.Tensor:
    """The token mixer on packed ``hidden`` [1, n, d], each sample starting fresh."""
    spans = micro.text_spans()
    if varlen_kernels(hidden.device):
        seq_idx = micro.cached("seq_idx", lambda: from_host(torch.repeat_interleave(
            torch.arange(len(spans.lengths), dtype=torch.int32),
            torch.tensor(spans.lengths))[None], hidden.device))
        return mixer(hidden, cu_seq_lens_q=spans.cu_seqlens.long(), seq_idx=seq_idx)
    return torch.cat([mixer(part) for part in hidden.split(spans.lengths, dim=1)], dim=1)


def linear_attention_block(layer: nn.Module, micro: Micro) -> torch.Tensor:
    """A linear-attention decoder layer (``layer``: the ``transformers`` module) on the packed
    tokens: the new hidden states [n, d]."""
    x = micro.x[None]
    h = x + mix_packed(layer.linear_attn, layer.input_layernorm(x), micro)
    return (h + layer.mlp(layer.post_attention_layernorm(h)))[0]
