"""InternVL (2.5, 3), as ``transformers`` models it natively (``InternVLForConditionalGeneration``,
``InternVLProcessor`` with ``GotOcr2ImageProcessor``).

Each image: ``<img>`` + ``<IMG_CONTEXT>`` × 256 per tile + ``</img>``, where the chat template
renders one ``<IMG_CONTEXT>`` per image; 448-px tiles chosen by aspect ratio, plus a thumbnail.
Position ids run 0..n-1 per sample.
"""

from __future__ import annotations

import numpy as np

from ..tiling import BICUBIC, IMAGENET_MEAN, IMAGENET_STD, InternVLTiling, TilingPolicy
from . import Family, ImageLayout, ModelFolder, processor_value


class InternVL(Family):
    name = "internvl"
    model_types = ("internvl",)

    def tiling(self, folder: ModelFolder) -> InternVLTiling:
        size = processor_value(folder, "size", {"height": 448, "width": 448})
        return InternVLTiling(
            image_size=int(size["height"]),
            min_patches=int(processor_value(folder, "min_patches", 1)),
            max_patches=int(processor_value(folder, "max_patches", 12)),
            crop_to_patches=bool(processor_value(folder, "crop_to_patches", True)),
            tokens_per_tile=int(processor_value(folder, "image_seq_length",
                                                _tokens_per_tile(folder.config))),
            mean=tuple(processor_value(folder, "image_mean", IMAGENET_MEAN)),
            std=tuple(processor_value(folder, "image_std", IMAGENET_STD)),
            resample=int(processor_value(folder, "resample", BICUBIC)),
            rescale_factor=float(processor_value(folder, "rescale_factor", 1 / 255)))

    def layout(self, folder: ModelFolder) -> ImageLayout:
        tokens = folder.special_tokens()
        context = tokens.get("context_image_token", "<IMG_CONTEXT>")
        return ImageLayout(placeholder=context, token=context,
                           prefix=(tokens.get("start_image_token", "<img>"),),
                           suffix=(tokens.get("end_image_token", "</img>"),))

    def position_ids(self, input_ids: np.ndarray, image_token_id: int,
                     grids: list[tuple[int, int, int]], policy: TilingPolicy) -> np.ndarray:
        return np.arange(len(input_ids), dtype=np.int64)


def _tokens_per_tile(config: dict) -> int:
    """(image_size / patch_size · downsample_ratio)², as ``InternVLProcessor`` documents."""
    vision = config.get("vision_config", {})
    image, patch = vision.get("image_size", [448, 448]), vision.get("patch_size", [14, 14])
    side = (image[0] if isinstance(image, list) else image) // (
        patch[0] if isinstance(patch, list) else patch)
    return int(side * config.get("downsample_ratio", 0.5)) ** 2
