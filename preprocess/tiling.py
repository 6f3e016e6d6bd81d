"""Image tiling policies: how many ViT units and LLM tokens an image costs, and its pixels.

Counting needs only the image size, so preprocessing reads headers and never decodes pixels. The
same policy objects are recorded in ``preprocess.json`` and the shards' manifest, and the loader
makes the model's ``pixel_values`` with ``pixels``, so the pixels always match the plan.

Both policies follow ``transformers``' own image processors (their PIL versions), with the limits
a model folder's ``preprocessor_config.json`` sets:

- ``internvl``: ``GotOcr2ImageProcessor`` with ``crop_to_patches``, as ``InternVLProcessor`` uses
  it. A *tile* is a 448×448 crop (plus a thumbnail when an image has more than one crop); the
  ViT runs on each tile; ``tokens_per_tile`` (256) image tokens each.
- ``qwen2vl``: ``Qwen2VLImageProcessor``'s ``smart_resize`` (Qwen2-VL and Qwen2.5-VL). A *tile*
  is one merged patch of 28×28 px: the merge² (4) ViT patches that become one LLM token. The
  ViT itself runs on ``merge_size²`` patches per tile.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace
from functools import lru_cache
from typing import TYPE_CHECKING, ClassVar, Protocol

import numpy as np

from vlmshard.rejects import Reject

from .config import TileBudget

if TYPE_CHECKING:
    from PIL import Image


IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
BICUBIC = 3  # PIL's filter number, as preprocessor_config.json writes ``resample``


class TilingPolicy(Protocol):
    name: str
    tokens_per_tile: int
    tile_size: int  # side of a tile's square of the resized image, in pixels
    rows_per_tile: int  # rows of pixel_values per tile (1 tile, or merge² ViT patches)
    pixel_shape: tuple[int, ...]  # the shape of one row of pixel_values
    takes_grid: bool  # whether the model's forward takes image_grid_thw

    def tiles(self, width: int, height: int, n_images: int) -> int:
        """Tiles for one image of a sample holding ``n_images`` images; raises ``Reject``."""

    def grid_thw(self, width: int, height: int) -> tuple[int, int, int] | None:
        """The image's ViT patch grid, where the model takes one (``image_grid_thw``)."""

    def pixels(self, image: "Image.Image", n_images: int) -> np.ndarray:
        """The model's float32 ``pixel_values`` rows for a decoded RGB image (one per tile for
        InternVL, one per ViT patch for Qwen2-VL), normalized as its processor does."""

    def to_dict(self) -> dict: ...


@dataclass(frozen=True)
class _Normalized:
    """What every processor does after resizing: ``x · rescale_factor``, minus mean, over std."""

    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    resample: int = BICUBIC
    rescale_factor: float = 1 / 255

    def normalize(self, pixels: np.ndarray) -> np.ndarray:
        """uint8 [..., H, W, 3] → float32 [..., 3, H, W]."""
        x = pixels.astype(np.float32) * np.float32(self.rescale_factor)
        x = (x - np.asarray(self.mean, np.float32)) / np.asarray(self.std, np.float32)
        return np.moveaxis(x, -1, -3)

    def resize(self, image: "Image.Image", width: int, height: int) -> np.ndarray:
        from PIL import Image

        return np.asarray(image.resize((width, height), Image.Resampling(self.resample)))

    def to_dict(self) -> dict:
        return {"name": self.name, **asdict(self)}


@dataclass(frozen=True)
class InternVLTiling(_Normalized):
    """``transformers``' InternVL processing: crop to a grid of tiles chosen by aspect ratio, then
    a thumbnail of the whole image when there is more than one tile."""

    mean: tuple[float, float, float] = IMAGENET_MEAN
    std: tuple[float, float, float] = IMAGENET_STD
    image_size: int = 448
    min_patches: int = 1
    max_patches: int = 12
    crop_to_patches: bool = True
    tokens_per_tile: int = 256
    # per-image: every image may use max_patches, as transformers applies it. per-sample: the
    # images of a sample share max_patches, as InternVL's own training code divides it.
    budget: TileBudget = "per-image"
    name: ClassVar[str] = "internvl"

    rows_per_tile: ClassVar[int] = 1
    takes_grid: ClassVar[bool] = False

    @property
    def tile_size(self) -> int:
        return self.image_size

    @property
    def pixel_shape(self) -> tuple[int, ...]:
        return 3, self.image_size, self.image_size

    def grid(self, width: int, height: int, n_images: int) -> tuple[int, int]:
        """(columns, rows) of crops, or (1, 1) when the image is only resized."""
        max_patches = self.max_patches
        if self.budget == "per-sample":
            max_patches = max(1, max_patches // max(1, n_images))
        if not self.crop_to_patches or max_patches <= 1:
            return 1, 1
        return tiled_canvas(width, height, min(self.min_patches, max_patches), max_patches,
                            self.image_size)

    def tiles(self, width: int, height: int, n_images: int) -> int:
        cols, rows = self.grid(width, height, n_images)
        return cols * rows + (cols * rows != 1)  # the thumbnail

    def grid_thw(self, width: int, height: int) -> None:
        return None  # InternVL's forward takes tiles, no grid

    def pixels(self, image: "Image.Image", n_images: int) -> np.ndarray:
        """[tiles, 3, S, S]: the crops row-major, then the thumbnail."""
        cols, rows = self.grid(image.width, image.height, n_images)
        size = self.image_size
        tiles = _cut_grid(self.resize(image, cols * size, rows * size), rows, cols, size)
        if cols * rows != 1:
            tiles = np.concatenate([tiles, self.resize(image, size, size)[None]])
        return self.normalize(tiles)


@lru_cache(maxsize=65536)
def tiled_canvas(width: int, height: int, min_tiles: int, max_tiles: int,
                 tile: int) -> tuple[int, int]:
    """The (columns, rows) grid ``transformers``' ``get_optimal_tiled_canvas`` picks.

    Grids with min ≤ columns·rows ≤ max, enumerated by columns then rows and sorted stably by
    area; the closest aspect ratio wins; on a tie the later (larger) grid wins while the image
    covers more than half of its pixels. Cached: sizes repeat a lot and the search is ~50 µs.
    """
    grids = sorted(((c, r) for c in range(1, max_tiles + 1) for r in range(1, max_tiles + 1)
                    if min_tiles <= c * r <= max_tiles), key=lambda g: g[0] * g[1])
    aspect, area = width / height, width * height
    best, best_diff = (1, 1), float("inf")
    for cols, rows in grids:
        diff = abs(aspect - cols / rows)
        if diff < best_diff:
            best, best_diff = (cols, rows), diff
        elif diff == best_diff and area > 0.5 * tile * tile * cols * rows:
            best = (cols, rows)
    return best


@dataclass(frozen=True)
class Qwen2VLTiling(_Normalized):
    """``transformers``' Qwen2-VL processing: ``smart_resize`` to multiples of patch·merge pixels
    with the pixel count in [min_pixels, max_pixels], then flattened ViT patches."""

    mean: tuple[float, float, float] = CLIP_MEAN
    std: tuple[float, float, float] = CLIP_STD
    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    tokens_per_tile: ClassVar[int] = 1
    takes_grid: ClassVar[bool] = True
    name: ClassVar[str] = "qwen2vl"

    @property
    def tile_size(self) -> int:
        return self.patch_size * self.merge_size

    @property
    def rows_per_tile(self) -> int:
        return self.merge_size ** 2

    @property
    def pixel_shape(self) -> tuple[int, ...]:
        return (3 * self.temporal_patch_size * self.patch_size ** 2,)

    def tiles(self, width: int, height: int, n_images: int) -> int:
        h, w = self.resized(width, height)
        return (h // self.tile_size) * (w // self.tile_size)

    def grid_thw(self, width: int, height: int) -> tuple[int, int, int]:
        """``image_grid_thw`` of an image: (1, ViT patch rows, ViT patch columns)."""
        h, w = self.resized(width, height)
        return 1, h // self.patch_size, w // self.patch_size

    def resized(self, width: int, height: int) -> tuple[int, int]:
        """(height, width) after ``smart_resize``. Tiny images are scaled up to ``min_pixels``,
        as current ``transformers`` does; only an aspect ratio over 200 is refused."""
        f = self.tile_size
        if max(height, width) / min(height, width) > 200:
            raise Reject("bad_aspect_ratio", f"{width}x{height} exceeds the 200:1 aspect ratio "
                                             "Qwen2-VL's processor accepts")
        h_bar, w_bar = round(height / f) * f, round(width / f) * f
        if h_bar * w_bar > self.max_pixels:
            beta = math.sqrt(height * width / self.max_pixels)
            h_bar = max(f, math.floor(height / beta / f) * f)
            w_bar = max(f, math.floor(width / beta / f) * f)
        elif h_bar * w_bar < self.min_pixels:
            beta = math.sqrt(self.min_pixels / (height * width))
            h_bar = math.ceil(height * beta / f) * f
            w_bar = math.ceil(width * beta / f) * f
        return h_bar, w_bar

    def pixels(self, image: "Image.Image", n_images: int) -> np.ndarray:
        """[patches, 3·T·P·P]: ``Qwen2VLImageProcessor``'s layout, patches ordered by merged
        patch (row-major), then row and column inside it; the frame repeated T times."""
        h, w = self.resized(image.width, image.height)
        p, m, t = self.patch_size, self.merge_size, self.temporal_patch_size
        x = self.normalize(self.resize(image, w, h))  # [3, H, W]
        x = x.reshape(3, h // (p * m), m, p, w // (p * m), m, p).transpose(1, 4, 2, 5, 0, 3, 6)
        x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], t, p, p))
        return np.ascontiguousarray(x).reshape(-1, 3 * t * p * p)


def _cut_grid(pixels: np.ndarray, rows: int, cols: int, size: int) -> np.ndarray:
    """An image of exactly (cols·size) × (rows·size) px as row-major tiles [rows·cols, S, S, 3]."""
    return (pixels.reshape(rows, size, cols, size, 3).transpose(0, 2, 1, 3, 4)
            .reshape(rows * cols, size, size, 3))


def to_rgb(image: "Image.Image") -> "Image.Image":
    """RGB as ``transformers`` converts: transparency composited onto white."""
    from PIL import Image

    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


POLICIES = {policy.name: policy for policy in (InternVLTiling, Qwen2VLTiling)}


def source_tiling(base: TilingPolicy, max_patches: int | None) -> TilingPolicy:
    """The policy for one source: an InternVL meta's ``max_dynamic_patch`` overrides the
    model's ``max_patches``."""
    if max_patches is not None and isinstance(base, InternVLTiling):
        return replace(base, max_patches=max_patches)
    return base


def tiling_from_dict(d: dict) -> TilingPolicy:
    """Inverse of ``policy.to_dict()``, for stages that read the recorded policy."""
    d = dict(d)
    cls = POLICIES[d.pop("name")]
    names = {f.name for f in fields(cls)}
    return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items() if k in names})
