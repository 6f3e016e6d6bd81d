"""What a gpu_bench.py run's MFU left out before the trainer counted it: a Qwen ViT's attention
across each image's patches.

    python benchmarks/vit_attention_count.py \
        --log benchmarks/results/h200-2026-11-27c/logs/balanced-train_log.jsonl

The trainer counts a step's model FLOPs from the analytic cost model (``model_sizes.
training_flops``). Its logs before ``Size.vit_squares`` had a ViT term linear in tiles, with
attention within a tile. That is right for InternVL and Gemma 3, whose ViT attends within a
tile, and not for the Qwen ViTs, whose tile is a merged 2×2 patch and whose attention spans the
image (a video's temporal step): 4·P²·h multiply-adds × 2 in the forward for P patches of width
h, twice that in the backward, in every block. A log that counts it (``vit_squares`` in its
micro-batch sizes) is checked instead: its squares must be the rebuilt samples'.

This script rebuilds the run's data with ``gpu_bench.py``'s own ``preprocessed`` (demo data at
``--scale``, a folder of Qwen3-VL-2B's sizes at the bench's image limit), checks that every
logged micro-batch's samples hold the tiles the log says, and prints per step the ViT attention
FLOPs (12·h·blocks·Σ P², P per image or video temporal step) beside the logged model FLOPs,
with the MFU each way. Writes ~4 GB (the folder's random bf16 weights) under ``--work``.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def attention_squares(row: dict) -> int:
    """Σ P² over a sample's ViT attention segments: an image's patches (4 a merged tile), each
    video temporal step's h·w patches (its grid is in patches)."""
    squares = sum((4 * tiles) ** 2 for tiles in row["image_tiles"])
    for video in row["videos"] or []:
        steps, h, w = video["grid"]
        squares += steps * (h * w) ** 2
    return squares


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--log", required=True, help="a gpu_bench.py plan's train_log.jsonl")
    p.add_argument("--work", default=os.path.join(REPO, "build", "vit_attention"))
    p.add_argument("--scale", type=int, default=4, help="the run's demo data scale")
    p.add_argument("--max-seq-len", type=int, default=8192)
    p.add_argument("--warmup", type=int, default=2, help="steps left out of the median")
    p.add_argument("--peak-tflops", type=float, default=989.0)
    args = p.parse_args()

    import pyarrow.parquet as pq

    import gpu_bench

    vit = gpu_bench.QWEN3_VL_2B["vision_sizes"]
    per_square = 12 * vit["hidden_size"] * vit["depth"]  # fwd + bwd FLOPs per patch pair
    _, pre = gpu_bench.preprocessed(args.work, args.scale, args.max_seq_len)
    rows = {}
    for path in sorted(glob.glob(os.path.join(pre, "stats", "part-*.parquet"))):
        for row in pq.read_table(path, columns=["sample_id", "image_tiles", "vit_tiles",
                                                "videos"]).to_pylist():
            rows[row["sample_id"]] = row
    peak = args.peak_tflops * 1e12
    print("| step | step s | logged model FLOPs | ViT attention FLOPs | share | MFU logged | "
          "MFU with it |\n|---:|---:|---:|---:|---:|---:|---:|")
    logged, counted = [], []
    with open(args.log, encoding="utf-8") as f:
        for line in f:
            record = json.loads(line)
            data = record["data"][0] if isinstance(record["data"], list) else record["data"]
            squares = 0
            for ids, size in zip(data["sample_ids"], data["micro_sizes"]):
                tiles = sum(rows[i]["vit_tiles"] for i in ids)
                if tiles != size["tiles"]:
                    sys.exit(f"step {record['step']}: the rebuilt samples hold {tiles} tiles, "
                             f"the log {size['tiles']}: not this run's data")
                rebuilt = sum(attention_squares(rows[i]) for i in ids)
                if size.get("vit_squares", rebuilt) != rebuilt:
                    sys.exit(f"step {record['step']}: the log counts {size['vit_squares']} "
                             f"squared patches, the rebuilt samples hold {rebuilt}")
                squares += 0 if "vit_squares" in size else rebuilt
            extra, flops, seconds = per_square * squares, record["model_flops"], \
                record["step_time_s"]
            mfu, mfu_with = flops / seconds / peak, (flops + extra) / seconds / peak
            if record["step"] >= args.warmup:
                logged.append(mfu)
                counted.append(mfu_with)
            print(f"| {record['step']} | {seconds:.3f} | {flops:.4g} | {extra:.4g} | "
                  f"{extra / flops:.1%} | {mfu:.1%} | {mfu_with:.1%} |")
    print(f"median MFU from step {args.warmup}: {statistics.median(logged):.1%} logged, "
          f"{statistics.median(counted):.1%} with the ViT's attention")


if __name__ == "__main__":
    main()
