"""Qwen2-VL and Qwen2.5-VL, as ``transformers`` models them (``Qwen2VLProcessor`` and
``Qwen2VLImageProcessor``; Qwen2.5-VL shares both for images).

Each image: the chat template renders ``<|vision_start|><|image_pad|><|vision_end|>`` and the
``<|image_pad|>`` becomes grid_h·grid_w / merge² of itself; ``smart_resize`` with the folder's
min/max pixels. Position ids are 3-D (mRoPE), computed per sample as ``get_rope_index`` does.
"""

from __future__ import annotations

import numpy as np

from ..tiling import BICUBIC, CLIP_MEAN, CLIP_STD, Qwen2VLTiling
from . import Family, ImageLayout, ModelFolder, processor_value


class Qwen2VL(Family):
    name = "qwen2vl"
    model_types = ("qwen2_vl", "qwen2_5_vl")

    def tiling(self, folder: ModelFolder) -> Qwen2VLTiling:
        size = processor_value(folder, "size", None) or {}
        # transformers: min_pixels / max_pixels, when given, override size's edges
        min_pixels = processor_value(folder, "min_pixels", size.get("shortest_edge", 56 * 56))
        max_pixels = processor_value(folder, "max_pixels",
                                     size.get("longest_edge", 28 * 28 * 1280))
        return Qwen2VLTiling(
            patch_size=int(processor_value(folder, "patch_size", 14)),
            merge_size=int(processor_value(folder, "merge_size", 2)),
            temporal_patch_size=int(processor_value(folder, "temporal_patch_size", 2)),
            min_pixels=int(min_pixels), max_pixels=int(max_pixels),
            mean=tuple(processor_value(folder, "image_mean", CLIP_MEAN)),
            std=tuple(processor_value(folder, "image_std", CLIP_STD)),
            resample=int(processor_value(folder, "resample", BICUBIC)),
            rescale_factor=float(processor_value(folder, "rescale_factor", 1 / 255)))

    def layout(self, folder: ModelFolder) -> ImageLayout:
        token = folder.special_tokens().get("image_token", "<|image_pad|>")
        return ImageLayout(placeholder=token, token=token)

    def position_ids(self, input_ids: np.ndarray, image_token_id: int,
                     grids: list[tuple[int, int, int]], policy: Qwen2VLTiling) -> np.ndarray:
        """[3, n] mRoPE ids: text runs count up on all three axes; an image's tokens take
        (t, row, column) of its merged grid offset by the position it starts at, and the text
        after it resumes at that offset + max(rows, columns)."""
        n, merge = len(input_ids), policy.merge_size
        out = np.empty((3, n), dtype=np.int64)
        is_image = input_ids == image_token_id
        i = pos = 0
        images = iter(grids)
        while i < n:
            if not is_image[i]:
                later = np.flatnonzero(is_image[i:])
                j = i + int(later[0]) if len(later) else n
                out[:, i:j] = pos + np.arange(j - i)
                pos += j - i
                i = j
                continue
            t, h, w = next(images)
            rows, cols = h // merge, w // merge
            count = t * rows * cols
            if i + count > n or not is_image[i:i + count].all():
                raise ValueError(f"image tokens at {i} do not hold the {count} of grid {t}x{h}x{w}")
            tt, hh, ww = np.meshgrid(np.arange(t), np.arange(rows), np.arange(cols),
                                     indexing="ij")
            out[:, i:i + count] = np.stack([tt.ravel(), hh.ravel(), ww.ravel()]) + pos
            pos += max(rows, cols)
            i += count
        return out
