"""Attention over packed samples without a Python loop: one backend, chosen when the model is built.

Packed samples must never attend to each other. The real ``transformers`` attention modules
compute q, k and v; the kernel they call is named by ``config._attn_implementation``:

- ``flash``: ``flash_attention_2`` (flash-attn's varlen kernel, CUDA only), given each sample's
  boundaries as ``cu_seq_lens_q/k`` and ``max_length_q/k``;
- ``sdpa``: ``vlmshard_packed_sdpa``, registered here: one ``scaled_dot_product_attention`` call
  with a block-diagonal mask (causal within each sample for the LLM, full within each image or
  window for a ViT), built once per micro-batch per stage.

``Spans`` holds one segmentation (its boundaries and, for ``sdpa``, its mask) and gives the
keyword arguments each layer passes to its ``transformers`` module.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

PACKED_SDPA = "vlmshard_packed_sdpa"
BACKENDS = ("flash", "sdpa")


def choose_backend(device: torch.device | str, dtype: torch.dtype = torch.float32) -> str:
    """``flash`` on CUDA in bf16/fp16 when flash-attn is installed (its kernels take no fp32),
    else ``sdpa``."""
    if (torch.device(device).type == "cuda" and dtype in (torch.bfloat16, torch.float16)
            and importlib.util.find_spec("flash_attn")):
        return "flash"
    return "sdpa"


def implementation(backend: str) -> str:
    """The ``attn_implementation`` name ``transformers`` uses for ``backend``."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; known: {', '.join(BACKENDS)}")
    return "flash_attention_2" if backend == "flash" else PACKED_SDPA


def packed_sdpa(module, query, key, value, attention_mask, *, packed_mask=None, **kwargs):
    """``transformers``' SDPA attention, with the packed block-diagonal mask when one is given
    (``packed_mask``: bool [1, 1, n, n], True where a query may attend, causality included)."""
    for name in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"):
        kwargs.pop(name, None)
    if packed_mask is not None:
        attention_mask = packed_mask
        kwargs["is_causal"] = False
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register(PACKED_SDPA, packed_sdpa)


@dataclass
class Spans:
    """Consecutive segments of a packed sequence that attend only within themselves."""

    cu_seqlens: torch.Tensor  # int32 [segments + 1], from 0 to the sequence length
    max_len: int
    mask: torch.Tensor | None  # the sdpa backend's block-diagonal mask

    @classmethod
    def from_lengths(cls, lengths: list[int], causal: bool, backend: str,
                     device: torch.device) -> "Spans":
        cu = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        mask = None
        if backend == "sdpa":
            segment = torch.repeat_interleave(torch.arange(len(lengths)),
                                              torch.tensor(lengths)).to(device)
            mask = segment[:, None] == segment[None, :]
            if causal:
                mask = mask.tril()
            mask = mask[None, None]
        return cls(cu.to(device), max(lengths, default=0), mask)

    def kwargs(self) -> dict:
        """Keyword arguments for a ``transformers`` attention layer call."""
        if self.mask is not None:
            return {"packed_mask": self.mask}
        return {"cu_seq_lens_q": self.cu_seqlens, "cu_seq_lens_k": self.cu_seqlens,
                "max_length_q": self.max_len, "max_length_k": self.max_len}
