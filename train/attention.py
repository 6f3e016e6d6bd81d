"""Attention over packed samples: the backends a ``transformers`` attention module calls, one
chosen when the model is built, so that packed samples never attend to each other.

- ``flash``: flash-attn's varlen kernel (``flash_attention_2``), given each sample's boundaries
  (``cu_seq_lens_q/k``, ``max_length_q/k``);
- ``varlen``: ``vlmshard_packed_varlen``, torch's own variable-length flash attention over the
  whole micro-batch in one call, called as the installed torch defines it
  (``varlen_parameters``);
- ``sdpa``: ``vlmshard_packed_sdpa``, ``scaled_dot_product_attention`` on each sample (in a Qwen
  ViT, each image or window) alone.

Each does Σ len² work, never (Σ len)² over a mask of the whole micro-batch. Gemma 3's sliding
windows and image tokens attended both ways follow the model's own mask functions. ``Spans``
holds one segmentation and gives each layer its module's keyword arguments;
``varlen_as_flash`` (``TORCH_VARLEN``) serves a plain ``transformers`` model packed by
``vlmshard.shards.model_inputs``; ``across_sequence`` attends over a sequence-parallel group's
micro-batch with this rank's heads.

Each backend, the torch releases it takes, and the masks: docs/training.md, "Attention
backends".
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import importlib
import importlib.util
import inspect
import logging
import math
from dataclasses import dataclass, field

import torch
from torch._C import DispatchKey
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

from vlmshard.errors import ConfigError
from vlmshard.shards.model_inputs import TORCH_VARLEN, allowed_keys

PACKED_SDPA = "vlmshard_packed_sdpa"
PACKED_VARLEN = "vlmshard_packed_varlen"
PACKED_ONE_CALL = "vlmshard_packed_flash_convention"  # see packed_one_call
# the same convention, each segment on SDPA whatever the backend (``Kernels.sdpa_cudnn``)
PACKED_ONE_CALL_SDPA = "vlmshard_packed_flash_convention_sdpa"
IMPLEMENTATIONS = {"flash": "flash_attention_2", "varlen": PACKED_VARLEN, "sdpa": PACKED_SDPA}

log = logging.getLogger(__name__)


def available_backends(device: torch.device | str, dtype: torch.dtype) -> list[str]:
    """The backends that run on ``device`` in ``dtype``, best first: the varlen kernels take
    bf16/fp16 on CUDA only, flash-attn and torch's varlen only where installed (torch's since
    2.10)."""
    half = dtype in (torch.bfloat16, torch.float16)
    cuda = torch.device(device).type == "cuda"
    flash = cuda and half and importlib.util.find_spec("flash_attn") is not None
    varlen = cuda and half and importlib.util.find_spec("torch.nn.attention.varlen") is not None
    return ["flash"] * flash + ["varlen"] * varlen + ["sdpa"]


def choose_backend(device: torch.device | str, dtype: torch.dtype = torch.float32,
                   wanted: str = "auto") -> str:
    """``wanted`` (a name of ``IMPLEMENTATIONS``), or the best of ``available_backends`` for
    "auto"; a backend that does not run on ``device`` in ``dtype`` is a ``ConfigError``."""
    available = available_backends(device, dtype)
    if wanted == "auto":
        return available[0]
    implementation(wanted)  # a known name
    if wanted not in available:
        raise ConfigError(f"attention: {wanted} does not run on {torch.device(device).type} in "
                          f"{str(dtype).removeprefix('torch.')}"
                          f"{' (flash-attn is not installed)' * (wanted == 'flash')}; here: "
                          f"{', '.join(available)}")
    return wanted


def implementation(backend: str) -> str:
    """The ``attn_implementation`` name ``transformers`` uses for ``backend``."""
    if backend not in IMPLEMENTATIONS:
        raise ValueError(f"unknown attention backend {backend!r}; known: "
                         f"{', '.join(IMPLEMENTATIONS)}")
    return IMPLEMENTATIONS[backend]


def sample_mask(length: int, runs: list[tuple[int, int]], window: int | None,
                device: torch.device) -> torch.Tensor:
    """[length, length] bool for one sample (``allowed_keys``): causal, or both in one of
    ``runs`` ([start, end) in the sample); with a ``window``, within it. Built on the device
    from host numbers: nothing is read back."""
    run = torch.full((length,), -1, dtype=torch.long, device=device)
    for k, (start, end) in enumerate(runs):
        run[start:end] = k
    return allowed_keys(torch.zeros_like(run), run, window)


def packed_sdpa(module, query, key, value, attention_mask, *, packed_spans=None,
                sliding_window=None, **kwargs):
    """``transformers``' SDPA attention on each packed segment alone (``packed_spans``' host
    lengths): Σ len² work, no mask over the micro-batch, grouped-query heads kept; causality as
    the module (or ``is_causal``) says, a sample's mask (``sample_mask``) where it has
    bidirectional runs (``Spans.runs``) or the module a ``sliding_window``, made once per
    micro-batch and window and shared by the layers (``Spans.masks``). Consecutive segments of
    one length that take no mask go in one call, as a batch (``sdpa_batches``): a video's
    frames, a Qwen2.5-VL ViT's full windows, images of one size."""
    for name in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"):
        kwargs.pop(name, None)
    if packed_spans is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    lengths = packed_spans.lengths
    runs = packed_spans.runs or [[]] * len(lengths)
    windows = [sliding_window if sliding_window and n > sliding_window else None
               for n in lengths]
    masked = [bool(r) or w is not None for r, w in zip(runs, windows)]
    masks = packed_spans.masks
    outputs, start = [], 0
    for first, end in sdpa_batches(lengths, masked):
        length, count = lengths[first], end - first
        # [count, heads, length, d]: views of [1, heads, tokens, d], no copy
        q, k, v = (t[0, :, start:start + count * length].unflatten(1, (count, length))
                   .transpose(0, 1) for t in (query, key, value))
        start += count * length
        mask = None
        if masked[first]:
            if (first, windows[first]) not in masks:
                masks[first, windows[first]] = sample_mask(length, runs[first], windows[first],
                                                           q.device)
            mask = masks[first, windows[first]]
        out = sdpa_attention_forward(module, q, k, v, mask, **kwargs)[0]
        outputs.append(out.reshape(1, count * length, *out.shape[2:]))
    return torch.cat(outputs, dim=1), None


def sdpa_batches(lengths: list[int], masked: list[bool]) -> list[tuple[int, int]]:
    """[first, end) ranges of segment indices, one SDPA call each: consecutive segments of one
    length where none takes a mask, and each ``masked`` segment alone."""
    batches: list[tuple[int, int]] = []
    for i, (length, mask) in enumerate(zip(lengths, masked)):
        if batches and not mask:
            first, end = batches[-1]
            if not masked[first] and lengths[first] == length:
                batches[-1] = (first, i + 1)
                continue
        batches.append((i, i + 1))
    return batches


@functools.lru_cache(maxsize=None)
def varlen_parameters(kernel) -> frozenset[str]:
    """The parameter names of ``kernel`` (torch's ``varlen_attn``), read once; logs what the
    installed release lacks and what is done instead."""
    names = frozenset(inspect.signature(kernel).parameters)
    if "window_size" not in names:
        log.info("torch %s's varlen_attn has no window_size: causal by is_causal, and layers "
                 "with a sliding window run on SDPA", torch.__version__)
    if "enable_gqa" not in names:
        log.info("torch %s's varlen_attn has no enable_gqa: K/V heads are repeated to the "
                 "query heads where they are fewer", torch.__version__)
    if "scale" not in names:
        log.info("torch %s's varlen_attn has no scale: layers whose scale is not 1/sqrt(head "
                 "dim) run on SDPA", torch.__version__)
    return names


def kernel_takes(names: frozenset[str], head_dim: int, scaling: float | None,
                 window: int | None) -> bool:
    """Whether torch's varlen kernel, whose ``varlen_attn`` has the parameters ``names``, runs
    a layer with this scale and sliding window: a window only where it takes ``window_size``,
    a scale other than its own 1/√head_dim only where it takes ``scale`` (neither in 2.10)."""
    own_scale = scaling is None or math.isclose(scaling, head_dim ** -0.5, rel_tol=1e-6)
    return (not window or "window_size" in names) and (own_scale or "scale" in names)


def repeats_kv_heads(backend: str) -> bool:
    """Whether ``backend`` hands its kernel K/V heads repeated to the query heads: torch's
    varlen kernel where it takes no grouped-query heads (before 2.12, ``packed_varlen``)."""
    if backend != "varlen":
        return False
    from torch.nn.attention.varlen import varlen_attn

    return "enable_gqa" not in varlen_parameters(varlen_attn)


def packed_varlen(module, query, key, value, attention_mask, *, packed_spans=None,
                  scaling=None, is_causal=None, sliding_window=None, **kwargs):
    """torch's varlen flash attention over every packed segment in one call (``packed_spans``'
    boundaries, on the device), a module's ``sliding_window`` as its window, called as the
    installed torch defines it (``varlen_parameters``); a single segment (``transformers`` runs
    a Qwen ViT image by image where ``vit_varlen`` is off) goes to SDPA, which takes its own
    flash kernel when given no mask, and so does a micro-batch with bidirectional runs or, where
    the kernel takes no window, a sliding window (each sample alone, ``packed_sdpa``)."""
    from torch.nn.attention.varlen import varlen_attn

    names = varlen_parameters(varlen_attn)
    for name in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"):
        kwargs.pop(name, None)
    spans = packed_spans
    if spans is not None and (any(spans.runs or ()) or not kernel_takes(
            names, query.shape[-1], scaling, sliding_window)):
        return packed_sdpa(module, query, key, value, None, packed_spans=spans,
                           sliding_window=sliding_window, scaling=scaling, **kwargs)
    if spans is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    q, k, v, options = _varlen_inputs(query, key, value, causal, scaling, sliding_window, names)
    out = varlen_attn(q, k, v, spans.cu_seqlens, spans.cu_seqlens, spans.max_len,
                      spans.max_len, **options)
    return out.unsqueeze(0), None


def _varlen_inputs(query, key, value, causal: bool, scaling, sliding_window, names):
    """q, k and v as torch's varlen kernel takes them, [tokens, heads, d] (no copy where the
    layout already is; K/V heads repeated where the kernel takes no fewer), and the keyword
    arguments of ``varlen_attn`` (whose parameter names are ``names``; where it has no
    ``scale``, the kernel's own is the layer's: ``kernel_takes``)."""
    q, k, v = (t.transpose(1, 2).squeeze(0).contiguous() for t in (query, key, value))
    options = {"scale": scaling} if "scale" in names else {}
    if "window_size" in names:
        left = sliding_window - 1 if sliding_window else -1
        options["window_size"] = (left, 0) if causal else (-1, -1)
    else:
        options["is_causal"] = causal
    if q.shape[1] != k.shape[1]:
        if "enable_gqa" in names:
            options["enable_gqa"] = True
        else:
            k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    return q, k, v, options


def varlen_as_flash(module, query, key, value, attention_mask, *, cu_seq_lens_q=None,
                    max_length_q=None, sliding_window=None, **kwargs):
    """flash-attn's convention (``transformers`` hands an implementation named "flash" each
    packed sample's boundaries, ``cu_seq_lens_q/k`` and ``max_length_q/k``, and no mask) on
    torch's varlen kernel where it runs, else on SDPA per sample: a plain ``transformers``
    model packed by ``model_inputs`` (``TORCH_VARLEN``: the Hugging Face ``Trainer`` peer of
    ``gpu_bench``) without flash-attn. Only the per-sample paths read the boundaries back."""
    for name in ("cu_seq_lens_k", "max_length_k"):
        kwargs.pop(name, None)
    if cu_seq_lens_q is None:  # one unpacked sequence
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      sliding_window=sliding_window, **kwargs)
    device = query.device.type
    if torch.is_autocast_enabled(device):  # as transformers' flash path: fp32 norms and rotary
        # leave q and k in fp32 under autocast, which a custom kernel is not cast for
        query, key, value = (t.to(torch.get_autocast_dtype(device)) for t in (query, key, value))
    backend = "varlen" if "varlen" in available_backends(query.device, query.dtype) else "sdpa"
    spans = Spans(cu_seq_lens_q.to(torch.int32), int(max_length_q), backend)
    return packed_one_call(module, query, key, value, None, packed_spans=spans,
                           sliding_window=sliding_window, **kwargs)


def attend_with_torch_varlen(model) -> None:
    """A loaded ``transformers`` model attends packed samples with ``varlen_as_flash``
    (``TORCH_VARLEN``): its config and sub-configs name it. Set after loading, since
    ``from_pretrained`` looks for flash-attn itself under a name that says "flash"."""
    config = model.config
    for sub in [config, *(getattr(config, name) for name in getattr(config, "sub_configs", {}))]:
        sub._attn_implementation = TORCH_VARLEN


def packed_one_call(module, query, key, value, attention_mask, *, packed_spans=None,
                    **kwargs):
    """The micro-batch's backend (``packed_spans.backend``, SDPA or torch's varlen) under a
    name that says "flash": ``transformers``' Qwen ViT attention hands an implementation so
    named every image's (or window's) boundaries in one call (its
    ``is_flash_attention_requested`` branch), where it calls any other once per image."""
    attend = packed_varlen if packed_spans.backend == "varlen" else packed_sdpa
    return attend(module, query, key, value, attention_mask, packed_spans=packed_spans,
                  **kwargs)


class LocalHeads:
    """An attention module as a kernel sees it after the sequence-parallel exchange: its
    grouped-query ratio that of the heads this rank holds (``transformers``' SDPA repeats K/V
    heads by the module's ``num_key_value_groups``)."""

    def __init__(self, module, groups: int) -> None:
        self._module = module
        self.num_key_value_groups = groups

    def __getattr__(self, name: str):
        return getattr(self._module, name)


def across_sequence(attend):
    """``attend`` over a sequence-parallel share (``packed_spans.sequence``): q, k and v
    exchanged to all tokens with this rank's heads, ``attend`` over the whole micro-batch's
    segments, the output exchanged back (``vlmshard.train.sequence_parallel``)."""
    @functools.wraps(attend)
    def attend_share(module, query, key, value, attention_mask, *, packed_spans=None, **kwargs):
        exchange = getattr(packed_spans, "sequence", None)
        if exchange is None:
            return attend(module, query, key, value, attention_mask, packed_spans=packed_spans,
                          **kwargs)
        q, k, v = exchange.heads_to_sequence(query, key, value)
        out, weights = attend(LocalHeads(module, q.shape[1] // k.shape[1]), q, k, v,
                              attention_mask, packed_spans=packed_spans, **kwargs)
        return exchange.sequence_to_heads(out), weights
    return attend_share


class _Heads:
    """What the kernels read of an attention module, inside the op (which takes no module)."""

    def __init__(self, groups: int, causal: bool) -> None:
        self.num_key_value_groups = groups
        self.is_causal = causal


def _attend(query, key, value, cu_seqlens, host_cu_seqlens, host_runs, kernel, causal, groups,
            scaling, window):
    """``kernel`` (``sdpa`` or ``varlen``) over the packed segments, from the op's arguments."""
    runs = None
    if len(host_runs):
        runs = [[] for _ in range(len(host_cu_seqlens) - 1)]
        for segment, start, end in host_runs.tolist():
            runs[segment].append((start, end))
    lengths = host_cu_seqlens.diff()
    spans = Spans(cu_seqlens, int(lengths.max()) if len(lengths) else 0, kernel, runs,
                  made_on_host=host_cu_seqlens)
    attend = packed_varlen if kernel == "varlen" else packed_sdpa
    return attend(_Heads(groups, causal), query, key, value, None, packed_spans=spans,
                  scaling=scaling, is_causal=causal, sliding_window=window)[0]


@dataclass(frozen=True)
class _VarlenOps:
    """torch's private ops behind ``varlen_attn`` (``torch_attn::_varlen_attn`` and its
    backward), called by the argument names torch 2.10 to 2.13 share (2.10's ops take no
    ``scale`` and no ``window_size``; read from each release's wheel), so that a compiled
    block's attention keeps the kernel's log-sum-exp and its backward runs the kernel's own
    (``packed_attention``)."""

    forward: object
    backward: object
    forward_names: frozenset[str]
    backward_names: frozenset[str]

    @staticmethod
    @functools.cache
    def installed() -> "_VarlenOps | None":
        """The ops where this torch has both with the arguments they are called with, for
        NVIDIA's kernels (ROCm's log-sum-exp has another shape); None elsewhere."""
        if torch.version.hip or importlib.util.find_spec("torch.nn.attention.varlen") is None:
            return None
        importlib.import_module("torch.nn.attention.varlen")  # registers the ops
        ops = getattr(torch.ops, "torch_attn", None)
        forward = getattr(ops, "_varlen_attn", None)
        backward = getattr(ops, "_varlen_attn_backward", None)
        if forward is None or backward is None:
            return None
        names = [frozenset(a.name for a in op.default._schema.arguments)
                 for op in (forward, backward)]
        needed = {"query", "key", "value", "cu_seq_q", "cu_seq_k", "max_q", "max_k",
                  "is_causal"}
        if not needed <= names[0] or not needed | {"grad_out", "out", "lse",
                                                   "rng_state"} <= names[1]:
            return None
        return _VarlenOps(forward.default, backward.default, *names)

    def call(self, query, key, value, host_cu_seqlens, host_runs, kernel: str, causal: bool,
             scaling, window) -> tuple | None:
        """(q, k and v as the kernel takes them, the keyword arguments both ops share) for
        this call of ``packed_attention``, or None where it does not run the kernel in one
        call (SDPA, bidirectional runs, a window the kernel does not take)."""
        if kernel != "varlen" or len(host_runs):
            return None
        from torch.nn.attention.varlen import varlen_attn

        names = varlen_parameters(varlen_attn)
        if not kernel_takes(names, query.shape[-1], scaling, window):
            return None
        q, k, v, options = _varlen_inputs(query, key, value, causal, scaling, window, names)
        if "window_size" in options:  # as varlen_attn calls its op
            options["window_size"] = list(options["window_size"])
            options["is_causal"] = options["window_size"] == [-1, 0]
        if not set(options) <= self.forward_names:
            return None
        lengths = host_cu_seqlens.diff()
        length = int(lengths.max()) if len(lengths) else 0
        return q, k, v, {"max_q": length, "max_k": length, **options}


@torch.library.custom_op("vlmshard::packed_attention", mutates_args=())
def packed_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     cu_seqlens: torch.Tensor, host_cu_seqlens: torch.Tensor,
                     host_runs: torch.Tensor, kernel: str, causal: bool, groups: int,
                     scaling: float | None, window: int | None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """The packed attention as one op of a compiled graph: the segments' boundaries are tensors
    (on the device for the kernel, on the host for the per-segment loop: ``Spans``), so a
    graph holds no length and guards on none. Returns [1, tokens, heads, d], as the kernels
    return, and where torch's varlen kernel ran in one call its log-sum-exp, [heads, tokens]
    in fp32, which its backward reads (``_VarlenOps``; elsewhere that tensor is unfilled)."""
    ops = _VarlenOps.installed()
    call = ops and ops.call(query, key, value, host_cu_seqlens, host_runs, kernel, causal,
                            scaling, window)
    if not call:
        out = _attend(query, key, value, cu_seqlens, host_cu_seqlens, host_runs, kernel,
                      causal, groups, scaling, window)
        return out.contiguous(), _lse_like(query)
    q, k, v, options = call
    out, lse, _ = ops.forward(query=q, key=k, value=v, cu_seq_q=cu_seqlens, cu_seq_k=cu_seqlens,
                              **options)
    return out.unsqueeze(0), lse


def _lse_like(query: torch.Tensor) -> torch.Tensor:
    return query.new_empty((query.shape[1], query.shape[2]), dtype=torch.float32)


@packed_attention.register_fake
def _(query, key, value, *args):
    return (query.new_empty((1, query.shape[2], query.shape[1], value.shape[-1])),
            _lse_like(query))


@torch.library.custom_op("vlmshard::packed_attention_backward", mutates_args=())
def packed_attention_backward(grad: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                              value: torch.Tensor, cu_seqlens: torch.Tensor,
                              host_cu_seqlens: torch.Tensor, host_runs: torch.Tensor,
                              out: torch.Tensor, lse: torch.Tensor, kernel: str, causal: bool,
                              groups: int, scaling: float | None,
                              window: int | None) -> list[torch.Tensor]:
    """``packed_attention``'s gradients. Where its forward ran torch's varlen kernel in one
    call, that kernel's backward on the forward's output and log-sum-exp (K/V gradients summed
    over the heads they were repeated to). Elsewhere its forward again under autograd, then
    its backward (one more forward of the attention kernels than eager). An op runs below
    autograd: its dispatch keys are let back in for the while (as torch's
    ``invoke_leaf_function`` does)."""
    ops = _VarlenOps.installed()
    call = ops and ops.call(query, key, value, host_cu_seqlens, host_runs, kernel, causal,
                            scaling, window)
    if not call:
        with _autograd_inside_op(), torch.enable_grad():
            inputs = [t.detach().requires_grad_() for t in (query, key, value)]
            again = _attend(*inputs, cu_seqlens, host_cu_seqlens, host_runs, kernel, causal,
                            groups, scaling, window)
            return [g.contiguous() for g in torch.autograd.grad(again, inputs, grad)]
    q, k, v, options = call
    options = {name: arg for name, arg in options.items() if name in ops.backward_names}
    grads = ops.backward(grad_out=grad.squeeze(0), query=q, key=k, value=v, out=out.squeeze(0),
                         lse=lse, cu_seq_q=cu_seqlens, cu_seq_k=cu_seqlens,
                         rng_state=torch.zeros(2, dtype=torch.uint64, device=q.device),
                         **options)
    dq, dk, dv = (g.unsqueeze(0).transpose(1, 2) for g in grads)
    if dk.shape[1] != key.shape[1]:  # repeated to the query heads
        dk, dv = (g.unflatten(1, (key.shape[1], -1)).sum(2) for g in (dk, dv))
    return [g.contiguous() for g in (dq, dk, dv)]


@contextlib.contextmanager
def _autograd_inside_op():
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for key in (DispatchKey.AutogradFunctionality, DispatchKey.AutogradOther,
                DispatchKey.AutogradNestedTensor):
        exclude = exclude.remove(key)
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude):
        yield


@packed_attention_backward.register_fake
def _(grad, query, key, value, *args):
    return [torch.empty_like(t, memory_format=torch.contiguous_format)
            for t in (query, key, value)]


def _setup_context(ctx, inputs, output) -> None:
    query, key, value, *rest = inputs
    ctx.save_for_backward(query, key, value, *rest[:3], *output)
    ctx.options = rest[3:]


def _backward(ctx, grad, _grad_lse):
    query, key, value, *boundaries, out, lse = ctx.saved_tensors
    grads = packed_attention_backward(grad.contiguous(), query, key, value, *boundaries, out,
                                      lse, *ctx.options)
    return (*grads, *[None] * (3 + len(ctx.options)))


packed_attention.register_autograd(_backward, setup_context=_setup_context)


def in_graph(kernel: str | None):
    """The registered attention: eager, ``kernel`` (``sdpa``, ``varlen``, or None: the spans'
    backend) called as it is; while ``torch.compile`` traces a block, ``packed_attention``, so
    the block's graph holds its attention whole and guards on no length (dynamic shapes make
    the boundaries' count a symbol)."""
    kernels = {"sdpa": packed_sdpa, "varlen": packed_varlen}

    def attend(module, query, key, value, attention_mask, *, packed_spans=None, scaling=None,
               is_causal=None, sliding_window=None, dropout=0.0, **kwargs):
        name = kernel or getattr(packed_spans, "backend", "sdpa")
        if packed_spans is None or not torch.compiler.is_compiling():
            return kernels[name](module, query, key, value, attention_mask,
                                 packed_spans=packed_spans, scaling=scaling, is_causal=is_causal,
                                 sliding_window=sliding_window, dropout=dropout, **kwargs)
        if dropout:
            raise ValueError("a compiled block's packed attention takes no dropout")
        causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
        groups = getattr(module, "num_key_value_groups", 1)
        out, _ = packed_attention(query, key, value, packed_spans.cu_seqlens,
                                  packed_spans.made_on_host, packed_spans.host_runs, name,
                                  causal, groups, scaling, sliding_window)
        return out, None
    return attend


AttentionInterface.register(PACKED_SDPA, across_sequence(in_graph("sdpa")))
AttentionInterface.register(PACKED_VARLEN, across_sequence(in_graph("varlen")))
AttentionInterface.register(PACKED_ONE_CALL, in_graph(None))
AttentionInterface.register(PACKED_ONE_CALL_SDPA, in_graph("sdpa"))
# a plain ``transformers`` model's (the peer's), never compiled here: boundaries from the device
AttentionInterface.register(TORCH_VARLEN, torch.compiler.disable(varlen_as_flash))
AttentionMaskInterface.register(TORCH_VARLEN, flash_attention_mask)


def from_host(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor on ``device`` without waiting for the device: on CUDA through pinned
    memory, asynchronously (a copy from pageable memory waits for the device's queue)."""
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


@dataclass
class Spans:
    """Consecutive segments of a packed sequence that attend only within themselves."""

    cu_seqlens: torch.Tensor  # int32 [segments + 1], from 0 to the sequence length
    max_len: int
    backend: str
    # per segment, [start, end) runs within it that attend bidirectionally (Gemma 3's images)
    runs: list[list[tuple[int, int]]] | None = None
    # SDPA's masks by (segment, window), made by the first layer that needs one
    masks: dict = field(default_factory=dict)
    # the segments are a whole micro-batch of which this rank holds a share: the exchanges
    # that attend over it (``vlmshard.train.sequence_parallel.Exchange``)
    sequence: object | None = None
    # ``cu_seqlens`` on the host where they were made there (``from_lengths``)
    made_on_host: torch.Tensor | None = field(default=None, repr=False)
    # ``runs`` on the host, a row (segment, start, end) each: what a compiled block's attention
    # op takes (``packed_attention``)
    host_runs: torch.Tensor = field(default_factory=lambda: torch.zeros(0, 3, dtype=torch.long),
                                    repr=False)

    @functools.cached_property
    def host_cu_seqlens(self) -> torch.Tensor:
        """The boundaries on the host, for code that reads them: as made, or read back from
        the device at first use (which waits for it: boundaries ``transformers`` hands over)."""
        return self.cu_seqlens.cpu() if self.made_on_host is None else self.made_on_host

    @functools.cached_property
    def lengths(self) -> list[int]:
        return self.host_cu_seqlens.diff().tolist()

    @classmethod
    def from_lengths(cls, lengths: list[int], backend: str, device: torch.device,
                     runs: list[tuple[int, int]] | None = None,
                     sequence: object | None = None) -> "Spans":
        """``runs``: bidirectional [start, end) runs of the whole sequence, none across a
        segment's end; ``sequence``: see the field."""
        cu = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        local, rows = None, []
        if runs is not None:
            starts = cu[:-1].tolist()
            local = [[] for _ in lengths]
            for start, end in runs:
                segment = bisect.bisect_right(starts, start) - 1
                local[segment].append((start - starts[segment], end - starts[segment]))
                rows.append((segment, *local[segment][-1]))
        return cls(from_host(cu, device), max(lengths, default=0), backend, local,
                   sequence=sequence, made_on_host=cu,
                   host_runs=torch.tensor(rows, dtype=torch.long).reshape(-1, 3))

    def kwargs(self) -> dict:
        """Keyword arguments for a ``transformers`` attention layer call: flash-attn takes the
        boundaries by ``transformers``' names, the backends registered here the spans whole
        (one object, which ``torch.compile`` does not guard on)."""
        if self.backend == "flash":
            return {"cu_seq_lens_q": self.cu_seqlens, "cu_seq_lens_k": self.cu_seqlens,
                    "max_length_q": self.max_len, "max_length_k": self.max_len}
        return {"packed_spans": self}


def supports_runs(backend: str) -> bool:
    """Whether ``backend`` keeps bidirectional runs (flash-attn's kernel takes none)."""
    return backend != "flash"
