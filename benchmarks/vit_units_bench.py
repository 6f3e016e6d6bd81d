"""What charging a Qwen ViT's attention across each image (``CostModel.a_vs``) buys the packer.

    python benchmarks/vit_units_bench.py [--samples 20000] [--seeds 3]

Qwen3-VL-8B's FLOPs (a 32-px tile, a ViT attending across each image), single-image chats whose
image sides are log-uniform between ``--min-side`` and ``--max-side`` px (1 to 6,400 tiles) with
50-1,500 text tokens. ``balanced`` packs them at 8 and 64 ranks, 4 micro-batches a rank, caps
16,384 tiles and 24,576 tokens, once under the full model and once with ``a_vs`` = 0 (the model
before it: the ViT's attention in no term); OmniBal's ``isf`` (which takes no cost model)
beside. Every plan is measured under the full model, the FLOPs the trainer runs
(``step_efficiency``: useful work over what the slowest rank makes every rank spend). Medians
over ``--seeds`` seeds. The first table says how much of the ViT's FLOPs the attention term is
at each image size.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import statistics
import sys

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from vlmshard.families import presets  # noqa: E402
from vlmshard.packing import algorithms  # noqa: E402
from vlmshard.packing.batches import Lengths  # noqa: E402
from vlmshard.packing.cost import CostModel  # noqa: E402
from vlmshard.packing.metrics import measure  # noqa: E402

CAPS = algorithms.Caps(16384, 24576)
MICRO_BATCHES = 4


def image_chats(n: int, seed: int, min_side: int, max_side: int, tile_px: int) -> Lengths:
    """``n`` single-image chats: a log-uniform image side, its tiles as one ViT unit."""
    rng = np.random.default_rng(seed)
    side = np.exp(rng.uniform(np.log(min_side), np.log(max_side), n))
    tiles = np.maximum((side // tile_px) ** 2, 1).astype(np.int64)
    text = rng.integers(50, 1500, n)
    return Lengths(tiles, tiles + text, np.zeros(n, np.int32), ("images",), tiles,
                   (0.6 * text).astype(np.int64), tiles.astype(np.float64) ** 2)


def pack(algo: str, lengths: Lengths, ranks: int, seed: int, cost: CostModel):
    ids = np.arange(len(lengths))
    if algo == "balanced":
        return algorithms.pack_balanced(lengths, ids, CAPS, ranks=ranks,
                                        micro_batches=MICRO_BATCHES, seed=seed, cost=cost)
    return algorithms.pack_isf(lengths, ids, CAPS, ranks=ranks, micro_batches=MICRO_BATCHES,
                               seed=seed)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=20000)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--min-side", type=int, default=224)
    p.add_argument("--max-side", type=int, default=2560)
    args = p.parse_args()
    model = presets()["qwen3-vl-8b"]
    full = CostModel.from_sizes(model)
    without = dataclasses.replace(full, a_vs=0.0)
    print(f"Command: `python benchmarks/vit_units_bench.py --samples {args.samples} --seeds "
          f"{args.seeds}`; {platform.machine()}, {os.cpu_count()} CPUs.\n")
    print("| image side | tiles | ViT attention / ViT FLOPs |\n|---:|---:|---:|")
    for side in (448, 1024, 2048, args.max_side):
        n = (side // model.vision.image_size) ** 2
        share = full.a_vs * n * n / (full.a_v * n + full.a_vs * n * n)
        print(f"| {side} px | {n:,} | {share:.1%} |")
    print("\n| ranks | balanced, model with a_vs | balanced, model without | isf | with / "
          "without |\n|---:|---:|---:|---:|---:|")
    for ranks in (8, 64):
        runs = {"with": ("balanced", full), "without": ("balanced", without), "isf": ("isf", full)}
        efficiency = {label: statistics.median(
            measure(lengths, pack(algo, lengths, ranks, seed, cost), qv=CAPS.qv, qt=CAPS.qt,
                    cost=full, padded=False, dp=ranks, pack_seconds=0.0).step_efficiency
            for seed in range(args.seeds)
            for lengths in [image_chats(args.samples, seed, args.min_side, args.max_side,
                                        model.vision.image_size)])
            for label, (algo, cost) in runs.items()}
        print(f"| {ranks} | {efficiency['with']:.4f} | {efficiency['without']:.4f} | "
              f"{efficiency['isf']:.4f} | {efficiency['with'] / efficiency['without']:.4f} |")

if __name__ == "__main__":
    main()
