"""The layers' optional kernels, each behind a switch (``Kernels``, from the train options):

- ``vit_varlen`` (``--vit-varlen``): a Qwen ViT block attends over every image or window of the
  micro-batch in one call of the attention backend (``attention.packed_one_call``);
- ``patch_linear`` (``--patch-linear``): the Qwen ViTs' patch embedding, a Conv3d whose stride
  is its kernel, as the matmul it is, on the conv's own weight;
- ``compile_blocks`` (``--compile-blocks``): regional ``torch.compile`` of each ViT block or
  decoder layer, one graph each with its attention and its recompute inside, dynamic shapes;
  every compilation is counted (``CompileCount``);
- ``sdpa_cudnn`` (``--sdpa-cudnn``): while a layer runs, ``scaled_dot_product_attention`` tries
  cuDNN's fused attention first (``cudnn_first``);
- ``liger`` (``--liger``): Liger Kernel's fused RMSNorm, gated-MLP and rotary kernels
  (``vlmshard.train.models.liger``; CUDA only), in the layers not compiled.

Why each exists, its default, and what the tests hold it to: docs/training.md, "Kernels".
"""

from __future__ import annotations

import dataclasses
import logging
import re
from dataclasses import dataclass

import torch
from torch import nn

from vlmshard.errors import ConfigError

from .recompute import in_graph_mode, recomputed

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Kernels:
    vit_varlen: bool = True
    liger: bool = False
    patch_linear: bool = False
    sdpa_cudnn: bool = False
    compile_blocks: tuple[str, ...] = ()  # parts: "vit", "llm"
    compile_backend: str = "inductor"
    max_recompiles: int = 4  # compilations of one frame beyond its first

    def __post_init__(self) -> None:
        if "vit" in self.compile_blocks and not self.vit_varlen:
            raise ConfigError("--compile-blocks vit takes --vit-varlen: without it transformers "
                              "reads each image's length back to the host inside the block")

    @classmethod
    def of(cls, cfg) -> "Kernels":
        """The switches a ``TrainConfig`` sets (its device defaults resolved)."""
        return cls(vit_varlen=cfg.vit_varlen, liger=bool(cfg.liger),
                   patch_linear=bool(cfg.patch_linear), sdpa_cudnn=cfg.sdpa_cudnn,
                   compile_blocks=tuple(cfg.compile_blocks),
                   max_recompiles=cfg.max_recompiles)

    def in_part(self, part: str) -> "Kernels":
        """The switches as a layer of ``part`` (``clock.PARTS``) takes them: its repeated block
        compiled where ``compile_blocks`` names the part."""
        return dataclasses.replace(self, compile_blocks=tuple(
            p for p in self.compile_blocks if p == part))


def compile_block(module: nn.Module, kernels: Kernels) -> None:
    """Compile ``module`` in place and count the process's compilations: its forward becomes
    ``torch.compile(checkpoint(forward))`` for the recompute mode the layer runs it under
    (``recompute.run_layer``; torchtitan's order), each compiled at first use. One graph a
    block (``fullgraph``): the packed attention is an op of the graph
    (``attention.packed_attention``), its boundaries tensors. ``dynamic=True``: the packed
    length and the boundaries' count are symbols from the first micro-batch on, never
    specialized on it and compiled again at the second. The weights' shapes stay static
    (``force_parameter_static_shapes``), so the hidden sizes do too. No duck sizing
    (process-wide): two inputs' sizes that happen to be equal at the first compilation (the
    image boundaries and the rotary table's width, say) would be one symbol, and a
    micro-batch where they differ would compile again."""
    import torch.fx.experimental._config as fx_config

    COMPILES.watch(kernels.max_recompiles)
    fx_config.use_duck_shape = False
    forward = module.forward
    compiled: dict[str | None, object] = {}

    def run(*args, **kwargs):
        mode = in_graph_mode()
        if mode not in compiled:
            compiled[mode] = torch.compile(recomputed(forward, mode), fullgraph=True,
                                           backend=kernels.compile_backend, dynamic=True)
        return compiled[mode](*args, **kwargs)

    module.forward = run
    module.compiled_in_place = True


def compiles_inside(layer) -> bool:
    """Whether ``layer`` (a module; anything else is not) holds a block ``compile_block``
    compiled: ``run_layer`` then leaves its recompute to the block's graph."""
    return isinstance(layer, nn.Module) and any(
        getattr(m, "compiled_in_place", False) for m in layer.modules())


def cudnn_first(module: nn.Module) -> None:
    """While ``module`` runs, ``scaled_dot_product_attention`` tries its backends in the order
    cuDNN, flash, memory-efficient, math (``sdpa_kernel``'s priority, set around each call:
    the setting is the process's)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    order = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
             SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    held = []

    def enter(*_):
        held.append(sdpa_kernel(order, set_priority=True))
        held[-1].__enter__()

    def leave(*_):
        held.pop().__exit__(None, None, None)

    module.register_forward_pre_hook(enter)
    module.register_forward_hook(leave, always_call=True)


class CompileCount:
    """``torch._dynamo``'s compilations in this process (``total``), each logged with the
    running count; a frame compiled again more than ``max_recompiles`` times is a warning
    (once per frame)."""

    def __init__(self) -> None:
        self.total = 0
        self.max_recompiles = 0

    def watch(self, max_recompiles: int) -> None:
        """Count from now on (``torch._dynamo.reset`` drops the hook: it is set again);
        ``max_recompiles``: the bound warned over."""
        from torch._dynamo.callback import callback_handler

        if self._started not in callback_handler.start_callbacks:
            callback_handler.register_start_callback(self._started)
        self.max_recompiles = max_recompiles

    def _started(self, args) -> None:
        from torch._dynamo.callback import CallbackTrigger

        if args.callback_trigger != CallbackTrigger.DYNAMO:
            return
        frame, attempt = re.match(r"\D*(\d+)/(\d+)", args.compile_id).groups()
        self.total += 1
        log.info("torch.compile: compilation %d of this run (frame %s, attempt %s)",
                 self.total, frame, attempt)
        if int(attempt) == self.max_recompiles + 1:
            log.warning("torch.compile recompiled frame %s %s times (more than %d): a shape "
                        "or value it guards on changes each micro-batch; see TORCH_LOGS="
                        "recompiles", frame, attempt, self.max_recompiles)


COMPILES = CompileCount()
