"""Independent references for the families' image processing, written from the published
algorithms (``transformers``' ``GotOcr2ImageProcessor`` with ``crop_to_patches``, as InternVL
uses it, and ``Qwen2VLImageProcessor``'s ``smart_resize`` and patch flattening), with PIL crop
boxes and explicit loops rather than the array reshapes the code under test uses."""

from __future__ import annotations

import math

import numpy as np
from PIL import Image


def internvl_grid(width: int, height: int, min_tiles: int, max_tiles: int,
                  tile: int) -> tuple[int, int]:
    """Candidate grids (columns, rows) with min ≤ c·r ≤ max, listed columns-major then sorted
    by area (stable); the closest aspect ratio wins, and a grid at exactly the same distance later
    in that order replaces it while the image has more than half of that grid's pixels."""
    grids = []
    for cols in range(1, max_tiles + 1):
        for rows in range(1, max_tiles + 1):
            if min_tiles <= cols * rows <= max_tiles:
                grids.append((cols, rows))
    grids.sort(key=lambda g: g[0] * g[1])
    best, best_diff = (1, 1), math.inf
    for cols, rows in grids:
        diff = abs(width / height - cols / rows)
        if diff < best_diff:
            best, best_diff = (cols, rows), diff
        elif diff == best_diff and width * height > 0.5 * tile * tile * cols * rows:
            best = (cols, rows)
    return best


def normalize(pixels: np.ndarray, mean, std) -> np.ndarray:
    """uint8 [..., H, W, 3] → float [..., 3, H, W]: /255, minus mean, over std, channel first."""
    x = pixels / 255.0
    return ((x - np.array(mean)) / np.array(std)).transpose(
        *range(x.ndim - 3), x.ndim - 1, x.ndim - 3, x.ndim - 2)


def internvl_pixels(image: Image.Image, max_patches: int, *, min_patches: int = 1,
                    tile: int = 448, mean=(0.485, 0.456, 0.406),
                    std=(0.229, 0.224, 0.225)) -> np.ndarray:
    """[tiles, 3, S, S]: resized (bicubic) to the grid, cropped row by row, then a thumbnail (the
    whole image resized to S × S) when there is more than one crop; one resize when max ≤ 1."""
    if max_patches <= 1:
        crops = [image.resize((tile, tile), Image.BICUBIC)]
    else:
        cols, rows = internvl_grid(image.width, image.height, min(min_patches, max_patches),
                                   max_patches, tile)
        resized = image.resize((cols * tile, rows * tile), Image.BICUBIC)
        crops = [resized.crop((c * tile, r * tile, (c + 1) * tile, (r + 1) * tile))
                 for r in range(rows) for c in range(cols)]
        if len(crops) > 1:
            crops.append(image.resize((tile, tile), Image.BICUBIC))
    return normalize(np.stack([np.asarray(c) for c in crops]), mean, std)


def smart_resize(width: int, height: int, factor: int = 28, min_pixels: int = 56 * 56,
                 max_pixels: int = 28 * 28 * 1280) -> tuple[int, int] | None:
    """(height, width) rounded to multiples of 28; over max_pixels: both sides scaled by
    sqrt(max_pixels / (h·w)) and floored (at least one factor); under min_pixels: scaled up by
    sqrt(min_pixels / (h·w)) and ceiled, tiny images included. None past a 200:1 aspect ratio."""
    if max(width, height) > 200 * min(width, height):
        return None
    h, w = round(height / factor) * factor, round(width / factor) * factor
    if h * w > max_pixels:
        scale = math.sqrt(max_pixels / (height * width))
        h = max(factor, math.floor(height * scale / factor) * factor)
        w = max(factor, math.floor(width * scale / factor) * factor)
    elif h * w < min_pixels:
        scale = math.sqrt(min_pixels / (height * width))
        h, w = (math.ceil(height * scale / factor) * factor,
                math.ceil(width * scale / factor) * factor)
    return h, w


def qwen2vl_pixels(image: Image.Image, *, min_pixels: int = 56 * 56,
                   max_pixels: int = 28 * 28 * 1280, patch: int = 14, merge: int = 2,
                   temporal: int = 2, mean=(0.48145466, 0.4578275, 0.40821073),
                   std=(0.26862954, 0.26130258, 0.27577711)) -> tuple[np.ndarray, tuple] | None:
    """([patches, 3·T·P·P], (1, grid_h, grid_w)): smart-resized (bicubic), normalized; patches in
    the processor's order, merged block by merged block (row-major), row and column inside a
    block; each row is the channels in turn, each the frame T times over, each P × P pixels."""
    size = smart_resize(image.width, image.height, patch * merge, min_pixels, max_pixels)
    if size is None:
        return None
    h, w = size
    x = normalize(np.asarray(image.resize((w, h), Image.BICUBIC)), mean, std)  # [3, H, W]
    rows = []
    for block_r in range(h // (patch * merge)):
        for block_c in range(w // (patch * merge)):
            for i in range(merge):
                for j in range(merge):
                    top = (block_r * merge + i) * patch
                    left = (block_c * merge + j) * patch
                    piece = x[:, top:top + patch, left:left + patch]  # [3, P, P]
                    rows.append(np.concatenate([np.tile(piece[c].ravel(), temporal)
                                                for c in range(3)]))
    return np.stack(rows), (1, h // patch, w // patch)
