"""Golden tile counts for each policy. InternVL cases are checked by hand against its rules:
grids with min_num ≤ i·j ≤ max_num sorted by area, closest aspect ratio wins, ties go to the later
grid when the image covers more than half of its pixels, thumbnail added when > 1 tile."""

import pytest

from vlmshard.preprocess.rejects import Reject
from vlmshard.preprocess.tiling import FixedTiling, InternVLTiling, Qwen2VLTiling, make_tiling, tiling_from_dict

# (width, height) -> tiles for a sample with 1, 2 and 3 images (max_num 12 split: 12, 6, 4)
INTERNVL_GOLDEN = {
    (448, 448): (1, 1, 1),      # exact 1:1, no thumbnail for a single tile
    (1024, 768): (13, 7, 5),    # 4:3 → 4×3 (+thumb); max 6 → 3×2; max 4 → 2×2 wins the 1:1 tie
    (1792, 448): (5, 5, 5),     # 4:1 exact
    (448, 1344): (4, 4, 4),     # 1:3; the 2×6 tie is refused (image < half of its area)
    (24, 18): (13, 7, 1),       # tiny 4:3 images are upsampled to the 4×3 grid, as InternVL does
    (1000, 1000): (10, 5, 5),   # 1:1 ties: 2×2 and 3×3 taken (area > half of grid area)
    (600, 600): (1, 1, 1),      # 1:1 tie at 2×2 refused: 360000 ≤ 0.5·448²·4
    (700, 700): (5, 5, 5),      # 490000 > 401408 takes 2×2; 3×3 refused
    (3000, 3000): (10, 5, 5),
    (1600, 200): (9, 7, 5),     # 8:1 exact; max 6 → 6×1; max 4 → 4×1
    (200, 1600): (9, 7, 5),
    (1240, 1754): (7, 7, 3),    # A4 portrait: 2×3 (0.667) beats 3×4 (0.75)
}


@pytest.mark.parametrize("size", sorted(INTERNVL_GOLDEN))
def test_internvl_golden(size):
    policy = InternVLTiling()
    assert tuple(policy.tiles(*size, n) for n in (1, 2, 3)) == INTERNVL_GOLDEN[size]


def test_internvl_min_num_and_thumbnail_off():
    assert InternVLTiling(max_num=12, min_num=4).tiles(448, 448, 1) == 5  # 2×2 + thumbnail
    assert InternVLTiling(use_thumbnail=False).tiles(1024, 768, 1) == 12


# (width, height) -> (resized height, resized width, tiles = LLM tokens)
QWEN2VL_GOLDEN = {
    (640, 480): (476, 644, 391),      # round to multiples of 28
    (4096, 3072): (840, 1148, 1230),  # over max_pixels: scaled down, floored
    (50, 30): (56, 84, 6),            # under min_pixels: scaled up, ceiled
    (448, 448): (448, 448, 256),
}


@pytest.mark.parametrize("size", sorted(QWEN2VL_GOLDEN))
def test_qwen2vl_golden(size):
    policy = Qwen2VLTiling()
    h, w, tiles = QWEN2VL_GOLDEN[size]
    assert policy.resized(*size) == (h, w)
    assert policy.tiles(*size, 1) == tiles
    assert policy.tokens_per_tile == 1


@pytest.mark.parametrize("size, reason", [((20, 100), "image_too_small"),
                                          ((28 * 201, 28), "bad_aspect_ratio")])
def test_qwen2vl_rejects(size, reason):
    with pytest.raises(Reject) as e:
        Qwen2VLTiling().tiles(*size, 1)
    assert e.value.reason == reason


def test_fixed_is_one_tile_of_576_tokens():
    policy = FixedTiling()
    assert [policy.tiles(w, h, 3) for w, h in [(24, 18), (4000, 100)]] == [1, 1]
    assert policy.tokens_per_tile == 576


def test_policy_round_trip_and_errors():
    for name in ("internvl", "qwen2vl", "fixed"):
        policy = make_tiling(name, max_num=6)
        assert tiling_from_dict(policy.to_dict()) == policy
    with pytest.raises(ValueError, match="unknown tiling policy 'tiles'"):
        make_tiling("tiles")
    with pytest.raises(ValueError, match="min_num <= max_num"):
        make_tiling("internvl", max_num=2, min_num=3)
