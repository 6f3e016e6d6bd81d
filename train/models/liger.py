"""Liger Kernel's fused Triton kernels in one built layer, in place (``Kernels.liger``; GPU only,
``pip install liger-kernel``): RMSNorm, the gated MLP's activation × up projection, and the
rotary embeddings, where Liger's own patch of each family puts them
(``liger_kernel.transformers.monkey_patch.apply_liger_kernel_to_<family>``, read at 0.8.5).

Liger's patch changes a whole process (a modeling module's classes and functions); this one
changes a layer's own modules, so a plain layer beside a fused one (a test's reference, the Hugging
Face peer of ``gpu_bench``) stays plain:

- each norm of a class in ``NORMS`` becomes a ``LigerRMSNorm`` holding the same weight, with the
  offset and casting mode Liger gives that class: Gemma 3's and Qwen3.5's (1 + weight) norm in
  fp32, Qwen's weight times the normalized value cast back (``llama``);
- each MLP with gate, up and down projections runs Liger's SiLU × up (SwiGLU) or GELU-tanh × up
  (GeGLU) kernel, the activation known by its class (``GATED``);
- while the layer's ``transformers`` module runs, the rotary functions its modeling module calls
  are Liger's (``ROPE``: the functions Liger swaps for these families; Qwen3.5's partial rotary
  has none).

Every kernel's backward writes its own output (``in_place=False``, as Liger's Gemma patches do):
a gradient handed in (by the pipeline engine, from a residual branch) is never overwritten.

Liger's fused linear + cross-entropy is not used: it reads the count of supervised tokens back
to the host once per call (a wait for the device each micro-batch, where a step may have two).
``models/loss.py`` fuses the head's matmul with its loss the same way, the count from the host.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import sys
import types

import torch
from torch import nn

# norm class -> (offset, casting mode), as Liger patches each family's RMSNorm
NORMS = {
    **{name: (0.0, "llama") for name in (
        "Qwen2RMSNorm", "Qwen3RMSNorm", "Qwen2VLRMSNorm", "Qwen2_5_VLRMSNorm",
        "Qwen3VLTextRMSNorm", "Qwen3VLMoeTextRMSNorm")},
    **{name: (1.0, "gemma") for name in ("Gemma3RMSNorm", "Qwen3_5RMSNorm", "Qwen3_5MoeRMSNorm")},
}

# activation class of a gated MLP -> Liger's fused "activation(gate) × up" function
GATED = {"SiLUActivation": "liger_swiglu", "SiLU": "liger_swiglu",
         "GELUTanh": "liger_geglu", "PytorchGELUTanh": "liger_geglu"}

# modeling module -> {its rotary function: Liger's}
_MODELS = "transformers.models."
ROPE = {
    **{f"{_MODELS}{m}.modeling_{m}": {"apply_multimodal_rotary_pos_emb":
                                      "liger_multimodal_rotary_pos_emb"}
       for m in ("qwen2_vl", "qwen2_5_vl")},
    **{f"{_MODELS}{m}.modeling_{m}": {"apply_rotary_pos_emb": "liger_rotary_pos_emb",
                                      "apply_rotary_pos_emb_vision": "liger_rotary_pos_emb_vision"}
       for m in ("qwen3_vl", "qwen3_vl_moe")},
    **{f"{_MODELS}{m}.modeling_{m}": {"apply_rotary_pos_emb": "liger_rotary_pos_emb"}
       for m in ("qwen2", "qwen3", "gemma3")},
}
_ROPE_HOME = {"liger_multimodal_rotary_pos_emb": "liger_kernel.transformers.qwen2vl_mrope",
              "liger_rotary_pos_emb": "liger_kernel.transformers.rope",
              "liger_rotary_pos_emb_vision": "liger_kernel.transformers.rope"}
# those that run on fp32 copies of q and k (the ViT's)
_UPCASTS = {"liger_rotary_pos_emb_vision"}


def available() -> bool:
    """Whether Liger can run here: CUDA, and ``liger_kernel`` installed."""
    return torch.cuda.is_available() and importlib.util.find_spec("liger_kernel") is not None


def fuse(layer: nn.Module, repeated: nn.Module | None) -> None:
    """Liger's kernels in ``layer``'s norms and gated MLPs, and its rotary functions while
    ``repeated`` (the layer's ``transformers`` block, if any) runs."""
    # Liger's backend registry warns, at import, of each optional backend it lacks (CuTe DSL,
    # Ascend) though it runs Triton's: two lines a process that say nothing of this run
    logging.getLogger("liger_kernel.backends.registry").setLevel(logging.ERROR)
    from liger_kernel.transformers import functional
    from liger_kernel.transformers.rms_norm import LigerRMSNorm

    for parent in list(layer.modules()):
        for name, child in list(parent.named_children()):
            style = NORMS.get(type(child).__name__)
            if style is not None:
                setattr(parent, name, _liger_norm(child, LigerRMSNorm, *style))
            elif _gated(child):
                fused = getattr(functional, GATED[type(child.act_fn).__name__])
                child.forward = types.MethodType(_gated_forward(fused), child)
    if repeated is not None:
        _rope_while_running(repeated)


def fuses(layer: nn.Module) -> bool:
    """Whether ``fuse`` swaps any of ``layer``'s modules: a norm of a class in ``NORMS`` or a
    gated MLP (a ViT's LayerNorms and plain MLP it leaves as they are)."""
    return any(type(m).__name__ in NORMS or _gated(m) for m in layer.modules())


def _liger_norm(norm: nn.Module, cls, offset: float, casting: str) -> nn.Module:
    eps = getattr(norm, "variance_epsilon", None) or norm.eps
    fused = cls(norm.weight.shape[0], eps=eps, offset=offset, casting_mode=casting,
                in_place=False)
    fused.weight = norm.weight  # the same parameter: its checkpoint name and gradient
    return fused


def _gated(module: nn.Module) -> bool:
    return (all(hasattr(module, p) for p in ("gate_proj", "up_proj", "down_proj"))
            and type(getattr(module, "act_fn", None)).__name__ in GATED)


def _gated_forward(fused):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(fused(self.gate_proj(x), self.up_proj(x)))
    return forward


def _on_copies(rope, upcasts: bool):
    """Liger's rotary kernel writes q and k in place: here on copies, so a tensor kept elsewhere
    is left as it was (selective recompute keeps a projection's output, which is q itself in a
    family without q/k norms). A function that ``upcasts`` its inputs to fp32 copies those that
    are not fp32 already itself."""
    def apply(q: torch.Tensor, k: torch.Tensor, *args, **kwargs):
        if not (upcasts and q.dtype != torch.float32 and k.dtype != torch.float32):
            q, k = q.clone(), k.clone()
        return rope(q, k, *args, **kwargs)
    return apply


def _rope_while_running(module: nn.Module) -> None:
    """Swap the modeling module's rotary functions for Liger's around each call of ``module``
    (its recompute in backward included), where Liger has them for its family."""
    swaps = ROPE.get(type(module).__module__)
    if not swaps:
        return
    home = sys.modules[type(module).__module__]
    liger = {name: _on_copies(getattr(importlib.import_module(_ROPE_HOME[fn]), fn),
                              fn in _UPCASTS)
             for name, fn in swaps.items() if hasattr(home, name)}
    plain = {name: getattr(home, name) for name in liger}

    def swap_in(*_):
        for name, fn in liger.items():
            setattr(home, name, fn)

    def swap_out(*_):
        for name, fn in plain.items():
            setattr(home, name, fn)

    module.register_forward_pre_hook(swap_in)
    module.register_forward_hook(swap_out, always_call=True)
