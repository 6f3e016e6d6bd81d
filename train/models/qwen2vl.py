"""Qwen2-VL and Qwen2.5-VL (``Qwen2VLForConditionalGeneration``, ``Qwen2_5_VL...``) as pipeline
layers.

The ViT runs on the packed patch rows of every image of the micro-batch at once: 2-D rotary
positions per patch, attention within each image (Qwen2-VL) or within each window, and within
each image on the ``fullatt_block_indexes`` blocks (Qwen2.5-VL, whose patches travel in window
order until the merger restores the image order), all computed as the model's own
``transformers.vision_utils`` helpers do. The merger turns 2×2 patches into one LLM token; the
LLM takes mRoPE position ids [3, n], each packed sample's computed for it alone.
"""

from __future__ import annotations

import functools
import types
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers.vision_utils import (
    get_vision_cu_seqlens,
    get_vision_position_ids,
    get_vision_window_index,
)

from ..attention import PACKED_ONE_CALL, PACKED_ONE_CALL_SDPA, Spans, from_host
from ..kernels import Kernels
from ..micro import Micro, Phase
from .layers import (
    Detached,
    Geometry,
    HFLayer,
    LayerDef,
    language_layers,
    visual_token_ids,
)

VISION = "model.visual"


@dataclass
class VisionMeta:
    """The micro-batch's ViT metadata, computed once per stage from its image grids."""

    rope: tuple[torch.Tensor, torch.Tensor]
    images: Spans
    windows: Spans | None  # Qwen2.5-VL
    window_index: torch.Tensor | None  # merged-patch order within windows (Qwen2.5-VL)
    grids: torch.Tensor  # [images, 3] (t, h, w), on the host


class VisionGeometry:
    """How one model's ViT lays out patches (held by each of its vision layers)."""

    def __init__(self, model: nn.Module) -> None:
        vision = model.get_submodule(VISION)
        self.merge = vision.spatial_merge_size
        self.windowed = hasattr(vision, "fullatt_block_indexes")
        self.full_blocks = set(getattr(vision, "fullatt_block_indexes", ()))
        self.window_size = getattr(vision, "window_size", 0)
        self.patch_size = vision.config.patch_size
        rotary = vision.rotary_pos_emb
        self.rotary = Detached(type(rotary)(rotary.config))

    def meta(self, micro: Micro) -> VisionMeta:
        return micro.cached("vision", lambda: self._compute(micro))

    def _compute(self, micro: Micro) -> VisionMeta:
        grids = torch.tensor(micro.host.grids, dtype=torch.long).reshape(-1, 3)
        device, backend = micro.x.device, micro.backend
        cu = get_vision_cu_seqlens(grids)
        images = Spans.from_lengths((cu[1:] - cu[:-1]).tolist(), backend, device)
        positions = from_host(get_vision_position_ids(grids, self.merge), device)
        rope = self.rotary(micro.x, positions)
        windows = window_index = None
        if self.windowed:
            window_index, cu_windows = get_vision_window_index(
                grids, self.merge, self.window_size, self.patch_size)
            windows = Spans.from_lengths((cu_windows[1:] - cu_windows[:-1]).tolist(), backend,
                                         device)
            window_index = from_host(window_index, device)
            rope = tuple(self.window_order(t, window_index) for t in rope)
        return VisionMeta(rope, images, windows, window_index, grids)

    def window_order(self, rows: torch.Tensor, window_index: torch.Tensor) -> torch.Tensor:
        unit = self.merge ** 2
        grouped = rows.reshape(rows.shape[0] // unit, unit, *rows.shape[1:])
        return grouped[window_index].reshape(rows.shape)


class VisionEmbedding(HFLayer):
    """The patch embedding. With ``patch_linear`` (``use_kernels``) the Conv3d of
    ``transformers``' patch embedding, whose stride is its kernel, runs as the matmul over each
    patch row it is, on its own weight (``_patch_matmul``); the conv is still called as a
    module, so ZeRO-3 gathers its weight around the call."""

    def __init__(self, model: nn.Module, geometry: VisionGeometry) -> None:
        super().__init__(model, {"patch_embed": f"{VISION}.patch_embed"})
        self.geometry = geometry
        self.linear = False

    def use_kernels(self, kernels: Kernels) -> None:
        if kernels.patch_linear:
            patch_embedding_as_matmul(self.patch_embed)
            self.linear = True
        super().use_kernels(kernels)

    def forward(self, micro: Micro) -> torch.Tensor:
        hidden = self.patch_embed(micro.x)
        if self.geometry.windowed:
            hidden = self.geometry.window_order(hidden, self.geometry.meta(micro).window_index)
        return hidden


def patch_embedding_as_matmul(patch_embed: nn.Module) -> None:
    """A Qwen ViT's patch embedding (``transformers``' module, its Conv3d in ``proj``) run as
    the one matmul per patch row its conv is (``_patch_matmul``): vlmshard's kernel, and the
    peers' in ``benchmarks/gpu_bench.py --baseline``."""
    proj = patch_embed.proj
    if (proj.stride, proj.padding, proj.dilation, proj.groups) != (
            proj.kernel_size, (0,) * 3, (1,) * 3, 1):
        raise ValueError(f"{type(patch_embed).__name__}'s Conv3d is not one matmul per patch: "
                         "--no-patch-linear")
    proj.forward = types.MethodType(_patch_matmul, proj)


def _patch_matmul(conv: nn.Conv3d, patches: torch.Tensor) -> torch.Tensor:
    """A Conv3d whose stride is its kernel, on [N, C, T, P, P] patches: one matmul on its own
    weight, [N, out, 1, 1, 1] as the conv returns it."""
    weight = conv.weight.flatten(1)  # [out, C·T·P·P]: a patch row's order
    return F.linear(patches.reshape(len(patches), -1), weight, conv.bias)[:, :, None, None, None]


class VisionBlock(HFLayer):
    """A ViT block over every image of the micro-batch, attending within each image (or
    window). ``transformers`` hands flash-attn every image's boundaries in one call and calls
    any other backend once per image; with ``vit_varlen`` (``use_kernels``) the block's
    attention goes to ``attention.packed_one_call``, which takes the one call too."""

    repeated = "block"

    def __init__(self, model: nn.Module, index: int, geometry: VisionGeometry) -> None:
        super().__init__(model, {"block": f"{VISION}.blocks.{index}"})
        self.geometry = geometry
        self.full = not geometry.windowed or index in geometry.full_blocks
        self.one_call = False

    def use_kernels(self, kernels: Kernels) -> None:
        config = self.block.attn.config  # this layer's own copy
        if kernels.vit_varlen and config._attn_implementation != "flash_attention_2":
            # with sdpa_cudnn each image on SDPA, which then takes cuDNN's kernel
            config._attn_implementation = (PACKED_ONE_CALL_SDPA if kernels.sdpa_cudnn
                                           else PACKED_ONE_CALL)
            self.one_call = True
        super().use_kernels(kernels)

    def forward(self, micro: Micro) -> torch.Tensor:
        meta = self.geometry.meta(micro)
        spans = meta.images if self.full else meta.windows
        if self.one_call or micro.backend == "flash":  # the boundaries to the kernel, at once
            kwargs = {"cu_seqlens": spans.cu_seqlens, "max_seqlen": spans.max_len}
            if self.one_call:
                kwargs["packed_spans"] = spans
        else:  # transformers runs SDPA on each segment alone; the boundaries on the host, as
            # it reads the segment lengths back (no device sync)
            kwargs = {"cu_seqlens": spans.host_cu_seqlens}
        return self.block(micro.x, position_embeddings=meta.rope, **kwargs)


class Merger(HFLayer):
    """2×2 patches -> one LLM token each, back in image order: [patches, Hv] -> [tiles, H]."""

    def __init__(self, model: nn.Module, geometry: VisionGeometry) -> None:
        super().__init__(model, {"merger": f"{VISION}.merger"})
        self.geometry = geometry

    def forward(self, micro: Micro) -> torch.Tensor:
        merged = self.merger(micro.x)
        if self.geometry.windowed:
            merged = merged[torch.argsort(self.geometry.meta(micro).window_index)]
        return merged


def layers(model: nn.Module) -> tuple[list[LayerDef], Geometry]:
    geometry = VisionGeometry(model)
    unit = geometry.merge ** 2
    patches = Phase("vision", unit)
    depth = len(model.get_submodule(f"{VISION}.blocks"))
    defs = [LayerDef("vit_embed", functools.partial(VisionEmbedding, geometry=geometry),
                     patches)]
    defs += [LayerDef(f"vit_block_{i}",
                      functools.partial(VisionBlock, index=i, geometry=geometry), patches,
                      variant="full" if geometry.windowed and i in geometry.full_blocks else "")
             for i in range(depth)]
    defs.append(LayerDef("projector", functools.partial(Merger, geometry=geometry),
                         Phase("features", 1)))
    rotary = model.get_submodule("model.language_model.rotary_emb")
    defs += language_layers(model, "model.language_model", visual_token_ids(model.config),
                            Detached(type(rotary)(rotary.config)))
    return defs, Geometry(pixel_rows_per_tile=unit, tokens_per_tile=1,
                          blank_grid=(1, geometry.merge, geometry.merge))
