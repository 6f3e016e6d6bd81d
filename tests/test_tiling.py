"""Tile counts and pixels of each family's image processing.

Counts: golden values checked by hand against the published rules (``transformers``'
``get_optimal_tiled_canvas`` for InternVL, ``smart_resize`` for Qwen2-VL). Pixels: equal, within
float rounding, to the independent references in ``image_references`` and to ``transformers``'
own (PIL) image processors."""

import image_references as ref
import numpy as np
import pytest
from PIL import Image

from vlmshard.families import policy_from_dict, source_tiling, to_rgb
from vlmshard.families.internvl import InternVLTiling
from vlmshard.families.qwen2vl import Qwen2VLTiling
from vlmshard.rejects import Reject

# (width, height) -> tiles of one image of a sample with 1, 2 and 3 images when the images share
# max_patches 12 (per-sample: 12, 6, 4 each)
INTERNVL_PER_SAMPLE = {
    (448, 448): (1, 1, 1),      # exact 1:1, no thumbnail for a single tile
    (1024, 768): (13, 7, 5),    # 4:3 → 4×3 (+thumb); max 6 → 3×2; max 4 → 2×2 wins the
                                # 1:1 tie
    (1792, 448): (5, 5, 5),     # 4:1 exact
    (448, 1344): (4, 4, 4),     # 1:3; the 2×6 tie is refused (image < half of its area)
    (24, 18): (13, 7, 1),       # tiny 4:3 images are upsampled to the 4×3 grid
    (1000, 1000): (10, 5, 5),   # 1:1 ties: 2×2 and 3×3 taken (area > half of grid area)
    (600, 600): (1, 1, 1),      # 1:1 tie at 2×2 refused: 360000 ≤ 0.5·448²·4
    (700, 700): (5, 5, 5),      # 490000 > 401408 takes 2×2; 3×3 refused
    (3000, 3000): (10, 5, 5),
    (1600, 200): (9, 7, 5),     # 8:1 exact; max 6 → 6×1; max 4 → 4×1
    (200, 1600): (9, 7, 5),
    (1240, 1754): (7, 7, 3),    # A4 portrait: 2×3 (0.667) beats 3×4 (0.75)
}


@pytest.mark.parametrize("size", sorted(INTERNVL_PER_SAMPLE))
def test_internvl_golden(size):
    shared = InternVLTiling(budget="per-sample")
    assert tuple(shared.tiles(*size, n) for n in (1, 2, 3)) == INTERNVL_PER_SAMPLE[size]
    # transformers' rule: every image of a sample may use max_patches
    own = InternVLTiling()
    assert {own.tiles(*size, n) for n in (1, 2, 3)} == {INTERNVL_PER_SAMPLE[size][0]}


def test_internvl_limits():
    assert InternVLTiling(min_patches=4).tiles(448, 448, 1) == 5  # 2×2 + thumbnail
    assert InternVLTiling(max_patches=1).tiles(1024, 768, 1) == 1  # resized, not cropped
    assert InternVLTiling(crop_to_patches=False).tiles(1024, 768, 1) == 1
    assert InternVLTiling(max_patches=2, budget="per-sample").tiles(1024, 768, 3) == 1
    meta = source_tiling(InternVLTiling(), 6)  # an InternVL meta's max_dynamic_patch
    assert meta.max_patches == 6 and meta.tiles(1024, 768, 1) == 7


# (width, height) -> (resized height, resized width, tiles = merged patches = LLM tokens)
QWEN2VL_GOLDEN = {
    (640, 480): (476, 644, 391),      # round to multiples of 28
    (4096, 3072): (840, 1148, 1230),  # over max_pixels: scaled down, floored
    (50, 30): (56, 84, 6),            # under min_pixels: scaled up, ceiled
    (448, 448): (448, 448, 256),
    (10, 10): (56, 56, 4),            # tiny: upscaled by min_pixels, as transformers does now
    (20, 100): (112, 28, 4),          # a side under 28 px rounds up to 28: 28·112 = min_pixels
}


@pytest.mark.parametrize("size", sorted(QWEN2VL_GOLDEN))
def test_qwen2vl_golden(size):
    policy = Qwen2VLTiling()
    h, w, tiles = QWEN2VL_GOLDEN[size]
    assert policy.resized(*size) == (h, w) == ref.smart_resize(*size)
    assert policy.tiles(*size, 1) == tiles
    assert policy.grid_thw(*size) == (1, h // 14, w // 14)
    assert policy.tokens_per_tile == 1 and policy.rows_per_tile == 4


def test_qwen2vl_rejects_only_extreme_aspect_ratios():
    with pytest.raises(Reject) as e:
        Qwen2VLTiling().tiles(28 * 201, 28, 1)
    assert e.value.reason == "bad_aspect_ratio"


def test_policy_round_trip():
    for policy in (InternVLTiling(max_patches=6, budget="per-sample", mean=(0.5, 0.5, 0.5)),
                   Qwen2VLTiling(min_pixels=100, max_pixels=10_000)):
        assert policy_from_dict(policy.to_dict()) == policy


SIZES = [(900, 500), (448, 448), (200, 1500), (3000, 800), (31, 29), (1000, 1000), (20, 100),
         (50, 30), (10, 10)]


def _image(size, mode="RGB"):
    rng = np.random.default_rng(sum(size))
    channels = {"RGB": 3, "RGBA": 4}[mode]
    return Image.fromarray(rng.integers(0, 255, (size[1], size[0], channels), dtype=np.uint8))


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("n_images", [1, 3])
def test_internvl_pixels_match_the_reference(size, n_images):
    image = _image(size)
    for policy, max_patches in ((InternVLTiling(max_patches=6), 6),
                                (InternVLTiling(max_patches=6, budget="per-sample"),
                                 max(1, 6 // n_images))):
        want = ref.internvl_pixels(image, max_patches)
        got = policy.pixels(image, n_images)
        assert policy.tiles(*size, n_images) == len(want) and got.dtype == np.float32
        np.testing.assert_allclose(got, want, atol=1e-5)  # well within 1/255 of a pixel


@pytest.mark.parametrize("size", SIZES)
def test_qwen2vl_pixels_match_the_reference(size):
    image = _image(size)
    policy = Qwen2VLTiling(max_pixels=28 * 28 * 300)
    want, grid = ref.qwen2vl_pixels(image, max_pixels=28 * 28 * 300)
    got = policy.pixels(image, 1)
    assert policy.grid_thw(*size) == grid
    assert got.shape == want.shape == (policy.tiles(*size, 1) * 4, 3 * 2 * 14 * 14)
    np.testing.assert_allclose(got, want, atol=1e-5)


@pytest.mark.parametrize("size", [(900, 500), (31, 29), (200, 1500)])
def test_pixels_match_transformers_own_image_processors(size):
    """transformers' PIL image processors run without torchvision: a second, official oracle."""
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    image = _image(size)
    hf = GotOcr2ImageProcessorPil(crop_to_patches=True, max_patches=6,
                                  size={"height": 448, "width": 448},
                                  image_mean=[0.485, 0.456, 0.406],
                                  image_std=[0.229, 0.224, 0.225])(image)
    np.testing.assert_allclose(InternVLTiling(max_patches=6).pixels(image, 1),
                               np.stack(hf["pixel_values"]), atol=1e-5)
    hf = Qwen2VLImageProcessorPil(min_pixels=3136, max_pixels=28 * 28 * 300)(image)
    policy = Qwen2VLTiling(max_pixels=28 * 28 * 300)
    np.testing.assert_allclose(policy.pixels(image, 1), hf["pixel_values"], atol=1e-5)
    assert tuple(hf["image_grid_thw"][0]) == policy.grid_thw(*size)


def test_transparency_is_composited_onto_white():
    rgba = _image((60, 40), "RGBA")
    array = np.asarray(rgba).astype(float)
    alpha = array[..., 3:] / 255
    want = np.round(array[..., :3] * alpha + 255 * (1 - alpha))
    np.testing.assert_allclose(np.asarray(to_rgb(rgba)), want, atol=1)
