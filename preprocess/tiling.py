"""Image tiling policies: how many ViT tiles and LLM tokens an image of a given size costs.

Only the image size is needed to count, so preprocessing reads headers and never decodes pixels.
The same policy objects are recorded in ``preprocess.json`` and the shards' manifest, and the
shard loader cuts decoded pixels with ``tile_pixels``, so the tiles always match the plan.

A *tile* is the policy's unit of ViT work:
- ``internvl``: a 448×448 crop (plus a thumbnail when an image has more than one crop);
  256 LLM tokens per tile.
- ``qwen2vl``: one 28×28 merged patch (2×2 ViT patches of 14 px); 1 LLM token per tile.
- ``fixed``: the whole image resized to one tile (LLaVA-1.5); 576 LLM tokens.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict, dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, ClassVar, Protocol

import numpy as np

from .rejects import Reject

if TYPE_CHECKING:
    from PIL import Image


IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


class TilingPolicy(Protocol):
    name: str
    tokens_per_tile: int
    tile_size: int  # side of a tile in pixels (pixel_values are [tiles, 3, tile_size, tile_size])
    mean: tuple[float, float, float]  # per-channel normalization of the model's ViT
    std: tuple[float, float, float]

    def tiles(self, width: int, height: int, n_images: int) -> int:
        """Tiles for one image of a sample holding ``n_images`` images."""

    def tile_pixels(self, image: "Image.Image", n_images: int) -> np.ndarray:
        """The decoded RGB image cut into ``tiles(w, h, n_images)`` uint8 tiles [n, S, S, 3]."""

    def to_dict(self) -> dict: ...


@dataclass(frozen=True)
class InternVLTiling:
    """InternVL's ``dynamic_preprocess``, reproduced bit for bit (grid choice and tie-breaks)."""

    max_num: int = 12
    min_num: int = 1
    image_size: int = 448
    use_thumbnail: bool = True
    tokens_per_tile: int = 256
    name: str = "internvl"
    mean: ClassVar = IMAGENET_MEAN
    std: ClassVar = IMAGENET_STD

    @property
    def tile_size(self) -> int:
        return self.image_size

    def grid(self, width: int, height: int, n_images: int) -> tuple[int, int]:
        # InternVL splits the tile budget across the images of a multi-image sample.
        max_num = max(1, self.max_num // max(1, n_images))
        min_num = min(self.min_num, max_num)
        return internvl_grid(width, height, min_num, max_num, self.image_size)

    def tiles(self, width: int, height: int, n_images: int) -> int:
        cols, rows = self.grid(width, height, n_images)
        blocks = cols * rows
        return blocks + 1 if self.use_thumbnail and blocks != 1 else blocks

    def tile_pixels(self, image: "Image.Image", n_images: int) -> np.ndarray:
        """``dynamic_preprocess``: resize to the grid, crop row-major, then the thumbnail."""
        from PIL import Image

        cols, rows = self.grid(image.width, image.height, n_images)
        size = self.image_size
        tiles = _cut_grid(image.resize((cols * size, rows * size), Image.BICUBIC), rows, cols,
                          size)
        if self.use_thumbnail and cols * rows != 1:
            thumbnail = np.array(image.resize((size, size), Image.BICUBIC))[None]
            tiles = np.concatenate([tiles, thumbnail])
        return tiles

    def to_dict(self) -> dict:
        return asdict(self)


@lru_cache(maxsize=65536)
def internvl_grid(width: int, height: int, min_num: int, max_num: int,
                  image_size: int) -> tuple[int, int]:
    """The (columns, rows) grid InternVL's ``dynamic_preprocess`` picks for an image.

    Cached: image sizes repeat a lot (camera and screenshot resolutions) and the search is ~50 µs.

    Kept in InternVL's exact form: candidates are built as a set and sorted stably by area, and the
    tie rule prefers a later (larger) grid when the image covers more than half of its pixels.
    """
    aspect_ratio = width / height
    target_ratios = set(
        (i, j) for n in range(min_num, max_num + 1) for i in range(1, n + 1)
        for j in range(1, n + 1) if min_num <= i * j <= max_num)
    target_ratios = sorted(target_ratios, key=lambda x: x[0] * x[1])
    best_diff = float("inf")
    best = (1, 1)
    area = width * height
    for ratio in target_ratios:
        diff = abs(aspect_ratio - ratio[0] / ratio[1])
        if diff < best_diff:
            best_diff = diff
            best = ratio
        elif diff == best_diff and area > 0.5 * image_size * image_size * ratio[0] * ratio[1]:
            best = ratio
    return best


@dataclass(frozen=True)
class Qwen2VLTiling:
    """Qwen2-VL's ``smart_resize``: both sides to multiples of 28 with the pixel count bounded."""

    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    factor: int = 28
    tokens_per_tile: int = 1
    name: str = "qwen2vl"
    mean: ClassVar = CLIP_MEAN
    std: ClassVar = CLIP_STD

    @property
    def tile_size(self) -> int:
        return self.factor

    def tiles(self, width: int, height: int, n_images: int) -> int:
        h, w = self.resized(width, height)
        return (h // self.factor) * (w // self.factor)

    def tile_pixels(self, image: "Image.Image", n_images: int) -> np.ndarray:
        """Smart-resized, then cut into factor × factor merged patches, row-major."""
        from PIL import Image

        h, w = self.resized(image.width, image.height)
        f = self.factor
        return _cut_grid(image.resize((w, h), Image.BICUBIC), h // f, w // f, f)

    def resized(self, width: int, height: int) -> tuple[int, int]:
        """(height, width) after smart-resize, as Qwen2-VL's image processor computes it."""
        f = self.factor
        if height < f or width < f:
            raise Reject("image_too_small",
                         f"{width}x{height} has a side under {f} px, which qwen2vl cannot tile")
        if max(height, width) / min(height, width) > 200:
            raise Reject("bad_aspect_ratio", f"{width}x{height} exceeds qwen2vl's 200:1 limit")
        h_bar = round(height / f) * f
        w_bar = round(width / f) * f
        if h_bar * w_bar > self.max_pixels:
            beta = math.sqrt(height * width / self.max_pixels)
            h_bar = math.floor(height / beta / f) * f
            w_bar = math.floor(width / beta / f) * f
        elif h_bar * w_bar < self.min_pixels:
            beta = math.sqrt(self.min_pixels / (height * width))
            h_bar = math.ceil(height * beta / f) * f
            w_bar = math.ceil(width * beta / f) * f
        return h_bar, w_bar

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class FixedTiling:
    """One tile per image, as LLaVA-1.5 (336 px, 24×24 patches = 576 tokens)."""

    image_size: int = 336
    tokens_per_tile: int = 576
    name: str = "fixed"
    mean: ClassVar = CLIP_MEAN
    std: ClassVar = CLIP_STD

    @property
    def tile_size(self) -> int:
        return self.image_size

    def tiles(self, width: int, height: int, n_images: int) -> int:
        return 1

    def tile_pixels(self, image: "Image.Image", n_images: int) -> np.ndarray:
        from PIL import Image

        return np.array(image.resize((self.image_size, self.image_size), Image.BICUBIC))[None]

    def to_dict(self) -> dict:
        return asdict(self)


def _cut_grid(image: "Image.Image", rows: int, cols: int, size: int) -> np.ndarray:
    """An image of exactly (cols·size) × (rows·size) px as row-major tiles [rows·cols, S, S, 3]."""
    pixels = np.array(image)  # writable: the loader hands tiles to torch without a copy
    return (pixels.reshape(rows, size, cols, size, 3).transpose(0, 2, 1, 3, 4)
            .reshape(rows * cols, size, size, 3))


POLICIES = {"internvl": InternVLTiling, "qwen2vl": Qwen2VLTiling, "fixed": FixedTiling}


def make_tiling(name: str, max_num: int = 12, min_num: int = 1) -> TilingPolicy:
    """Build a policy by name; ``max_num``/``min_num`` apply to ``internvl`` only."""
    if name == "internvl":
        if not 1 <= min_num <= max_num:
            raise ValueError(f"need 1 <= min_num <= max_num, got min_num={min_num}, max_num={max_num}")
        return InternVLTiling(max_num=max_num, min_num=min_num)
    if name in POLICIES:
        return POLICIES[name]()
    raise ValueError(f"unknown tiling policy {name!r}: choose one of {', '.join(POLICIES)}")


def source_tiling(base: TilingPolicy, max_num: int | None) -> TilingPolicy:
    """The policy for one source: an InternVL meta's ``max_dynamic_patch`` overrides ``max_num``."""
    if max_num is not None and isinstance(base, InternVLTiling):
        return dataclasses.replace(base, max_num=max_num)
    return base


def tiling_from_dict(d: dict) -> TilingPolicy:
    """Inverse of ``policy.to_dict()``, for stages that read the recorded policy."""
    d = dict(d)
    return POLICIES[d.pop("name")](**d)
