"""Attention over packed samples without a Python loop: one backend, chosen when the model is built.

Packed samples must never attend to each other. The real ``transformers`` attention modules
compute q, k and v; the kernel they call is named by ``config._attn_implementation``:

- ``flash``: ``flash_attention_2`` (flash-attn's varlen kernel, CUDA only), given each sample's
  boundaries as ``cu_seq_lens_q/k`` and ``max_length_q/k``;
- ``sdpa``: ``vlmshard_packed_sdpa``, registered here: ``scaled_dot_product_attention`` on
  each sample alone (the LLM, causal; the boundaries on the host), and in a Qwen ViT on each
  image or window alone, as ``transformers`` runs it given the boundaries on the host. Σ len²
  work, where one call with a block-diagonal mask over the micro-batch did (Σ len)²: at 10⁴
  tokens or patches a micro-batch that made a fuller micro-batch cost more than its share.

``Spans`` holds one segmentation (its boundaries, on the device and the host) and gives the
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


def packed_sdpa(module, query, key, value, attention_mask, *, packed_lengths=None, **kwargs):
    """``transformers``' SDPA attention on each packed segment alone (``packed_lengths``, on the
    host): Σ len² work, no mask over the micro-batch, grouped-query heads kept; causality as
    the module (or ``is_causal``) says."""
    for name in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"):
        kwargs.pop(name, None)
    if packed_lengths is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    parts = zip(*(t.split(packed_lengths, dim=2) for t in (query, key, value)))
    outputs = [sdpa_attention_forward(module, q, k, v, None, **kwargs)[0] for q, k, v in parts]
    return torch.cat(outputs, dim=1), None


AttentionInterface.register(PACKED_SDPA, packed_sdpa)


@dataclass
class Spans:
    """Consecutive segments of a packed sequence that attend only within themselves."""

    cu_seqlens: torch.Tensor  # int32 [segments + 1], from 0 to the sequence length
    host_cu_seqlens: torch.Tensor  # the same on the host, for code that reads them back
    max_len: int
    lengths: list[int]  # on the host
    backend: str

    @classmethod
    def from_lengths(cls, lengths: list[int], backend: str, device: torch.device) -> "Spans":
        cu = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        return cls(cu.to(device), cu, max(lengths, default=0), list(lengths), backend)

    def kwargs(self) -> dict:
        """Keyword arguments for a ``transformers`` attention layer call."""
        if self.backend == "sdpa":
            return {"packed_lengths": self.lengths}
        return {"cu_seq_lens_q": self.cu_seqlens, "cu_seq_lens_k": self.cu_seqlens,
                "max_length_q": self.max_len, "max_length_k": self.max_len}
