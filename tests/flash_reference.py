"""CPU kernels for the two flash-attention ops torch's varlen attention calls (a GPU's only),
computed as FlashAttention's paper defines them, so that the CPU suite can run the GPU's path
(``torch.nn.attention.varlen``, ``vlmshard::packed_attention``'s use of its backward) on real
numbers: per segment of the packed [tokens, heads, d] inputs, the forward's output and
log-sum-exp [heads, tokens]; the backward from the output and log-sum-exp alone (P = exp(S -
lse), dV = Pᵀ·dO, dS = P∘(dO·Vᵀ - rowsum(dO∘O)), dQ = dS·K·scale, dK = dSᵀ·Q·scale), K/V heads
fewer than the query's summed over the heads they serve. ``calls`` counts each op's calls.
``sdpa_by_segment`` is what those kernels should give, from SDPA on each segment alone;
``against_sdpa`` holds an attention to it on the reference kernels."""

from __future__ import annotations

import contextlib
import math
from collections import Counter

import torch


def _scores(q, k, scale, causal, left):
    """[heads, L, L] scores of one segment, masked: causal, and a window of ``left`` tokens."""
    heads = q.shape[1]
    k = k.repeat_interleave(heads // k.shape[1], dim=1)
    s = torch.einsum("qhd,khd->hqk", q, k) * scale
    n = q.shape[0]
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    keep = torch.ones(n, n, dtype=torch.bool)
    if causal:
        keep &= j <= i
    if left is not None and left >= 0:
        keep &= j >= i - left
    return s.masked_fill(~keep, float("-inf"))


def _segments(cu):
    bounds = cu.tolist()
    return list(zip(bounds, bounds[1:]))


@contextlib.contextmanager
def flash_on_cpu():
    """The reference kernels registered for CPU while inside; yields the call counter."""
    calls: Counter[str] = Counter()

    def forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                return_debug_mask, *, scale=None, window_size_left=None, window_size_right=None,
                **_):
        calls["forward"] += 1
        scale = scale if scale is not None else 1 / math.sqrt(query.shape[-1])
        out = torch.empty_like(query)
        lse = query.new_empty(query.shape[1], query.shape[0], dtype=torch.float32)
        heads = query.shape[1]
        for a, b in _segments(cum_seq_q):
            s = _scores(query[a:b], key[a:b], scale, is_causal or window_size_right == 0,
                        window_size_left)
            lse[:, a:b] = torch.logsumexp(s, dim=-1)
            p = torch.exp(s - lse[:, a:b, None])
            v = value[a:b].repeat_interleave(heads // value.shape[1], dim=1)
            out[a:b] = torch.einsum("hqk,khd->qhd", p, v)
        empty = query.new_empty(0)
        return out, lse, torch.zeros(2, dtype=torch.uint64), empty, empty

    def backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q,
                 max_k, dropout_p, is_causal, rng_state, unused, *, scale=None,
                 window_size_left=None, window_size_right=None):
        calls["backward"] += 1
        scale = scale if scale is not None else 1 / math.sqrt(query.shape[-1])
        heads, kv = query.shape[1], key.shape[1]
        dq, dk, dv = (torch.zeros_like(t) for t in (query, key, value))
        for a, b in _segments(cum_seq_q):
            s = _scores(query[a:b], key[a:b], scale, is_causal or window_size_right == 0,
                        window_size_left)
            p = torch.exp(s - logsumexp[:, a:b, None])
            do, o = grad_out[a:b], out[a:b]
            k = key[a:b].repeat_interleave(heads // kv, dim=1)
            v = value[a:b].repeat_interleave(heads // kv, dim=1)
            dv_h = torch.einsum("hqk,qhd->khd", p, do)
            dp = torch.einsum("qhd,khd->hqk", do, v)
            ds = p * (dp - (do * o).sum(-1).T[:, :, None])
            dq[a:b] = torch.einsum("hqk,khd->qhd", ds, k) * scale
            dk_h = torch.einsum("hqk,qhd->khd", ds, query[a:b]) * scale
            dk[a:b] = dk_h.unflatten(1, (kv, heads // kv)).sum(2)
            dv[a:b] = dv_h.unflatten(1, (kv, heads // kv)).sum(2)
        return dq, dk, dv

    lib = torch.library.Library("aten", "IMPL")
    lib.impl("_flash_attention_forward", forward, "CPU")
    lib.impl("_flash_attention_backward", backward, "CPU")
    try:
        yield calls
    finally:
        lib._destroy()


def sdpa_by_segment(query, key, value, cu: torch.Tensor, causal: bool, window: int | None,
                    scale: float) -> torch.Tensor:
    """[1, tokens, heads, d]: each segment of [1, heads, tokens, d] inputs alone through SDPA
    (K/V heads grouped), causal or not, a causal ``window`` of keys (key > query - window)."""
    from torch.nn.functional import scaled_dot_product_attention

    parts = []
    for a, b in _segments(cu):
        n = b - a
        i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
        keep = (j <= i) if causal else torch.ones(n, n, dtype=torch.bool)
        if causal and window:
            keep &= j > i - window
        parts.append(scaled_dot_product_attention(
            *(t[:, :, a:b] for t in (query, key, value)), attn_mask=keep, scale=scale,
            enable_gqa=True))
    return torch.cat(parts, dim=2).transpose(1, 2)


def against_sdpa(attend, causal: bool, window: int | None, scale: float):
    """Run ``attend(query, key, value, cu_seqlens)`` ([1, heads, tokens, d] in, [1, tokens,
    heads, d] out) on 3 packed segments of 5, 9 and 3 tokens, 4 query heads over 2 K/V heads,
    head dim 8, under the reference kernels; assert its output and q, k, v gradients within
    1e-5 of ``sdpa_by_segment``'s; return the kernels' calls."""
    torch.manual_seed(0)
    lengths, heads, kv = [5, 9, 3], 4, 2
    cu = torch.tensor([0, 5, 14, 17], dtype=torch.int32)
    query, key, value = (torch.randn(1, n, sum(lengths), 8, requires_grad=True)
                         for n in (heads, kv, kv))
    weights = torch.randn(1, sum(lengths), heads, 8)
    inputs = [query, key, value]
    with flash_on_cpu() as calls:
        out = attend(query, key, value, cu)
        got = [out, *torch.autograd.grad((out * weights).sum(), inputs)]
    want_out = sdpa_by_segment(query, key, value, cu, causal, window, scale)
    want = [want_out, *torch.autograd.grad((want_out * weights).sum(), inputs)]
    for name, g, w in zip(["out", "query", "key", "value"], got, want):
        assert g.shape == w.shape and torch.allclose(g, w, atol=1e-5, rtol=1e-5), name
    return calls
