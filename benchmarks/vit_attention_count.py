"""A gpu_bench.py run's MFU recounted as the trainer counts it now: a Qwen ViT's attention
across each image's patches in, the LM head on the supervised tokens only.

    python benchmarks/vit_attention_count.py \
        --log benchmarks/results/h200-2026-11-27c/logs/balanced-train_log.jsonl \
        --replay benchmarks/results/h200-2026-11-27c

The trainer counts a step's model FLOPs from the analytic cost model (``model_sizes.
training_flops``). Its logs before ``CostTerms.vit_squares`` had a ViT term linear in tiles, with
attention within a tile. That is right for InternVL and Gemma 3, whose ViT attends within a
tile, and not for the Qwen ViTs, whose tile is a merged 2×2 patch and whose attention spans the
image (a video's temporal step): 2·P²·h multiply-adds (q·kᵀ and its product with v; 4·P²·h
FLOPs) in the forward for P patches of width h, twice that in the backward, in every block. A
log that counts it (``vit_squares`` in its micro-batch sizes) is checked instead: its squares
must be the rebuilt samples'.

A log from before ``CostTerms.supervised`` charged the LM head (6·h·V FLOPs a token, forward
and backward) for every token, where ``lm_loss`` makes logits for the supervised ones only: its
unsupervised tokens' share is taken off. Every MFU is the kept steps' FLOPs over their time
(Σ/Σ), as ``gpu_bench.py`` reports it.

This script rebuilds the run's data with ``gpu_bench.py``'s own ``preprocessed`` (demo data at
``--scale``, a folder of Qwen3-VL-2B's sizes at the bench's image limit), checks that every
logged micro-batch's samples hold the tiles the log says, and prints per step the ViT attention
FLOPs (12·h·blocks·Σ P², P per image or video temporal step) beside the logged model FLOPs,
with the MFU each way, and with the LLM's causal attention counted as the full square too (the
convention of Megatron-LM's, torchtitan's and llm-foundry's MFU). ``--replay``: the
simulator's replay of the run per layer kind (as gpu_bench.py replays it) as logged and with
the ViT's attention in the log's and the profile's sizes, step by step. Writes ~4 GB (the
folder's random bf16 weights) under ``--work``.
"""

from __future__ import annotations

import argparse
import copy
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
    p.add_argument("--warmup", type=int, default=2, help="steps left out of the sums")
    p.add_argument("--peak-tflops", type=float, default=989.0)
    p.add_argument("--replay", metavar="RESULTS",
                   help="a lease's results folder (profile.json, pipeline-balanced.json): replay "
                        "the log per layer kind as it was logged and with the ViT's attention "
                        "in its sizes and the profile's, side by side")
    args = p.parse_args()

    import pyarrow.parquet as pq

    import gpu_bench

    vit, text = gpu_bench.QWEN3_VL_2B["vision_sizes"], gpu_bench.QWEN3_VL_2B["text_sizes"]
    per_square = 12 * vit["hidden_size"] * vit["depth"]  # fwd + bwd FLOPs per patch pair
    # the LLM's causal attention (all of its layers full attention), counted as the half
    # square it computes: the other half, which MFU conventions that take it as the full
    # square add (QKᵀ and AV, 2 × 2·q FLOPs per squared sample length forward, 3× with backward)
    per_causal = 6 * text["num_attention_heads"] * text["head_dim"] * text["num_hidden_layers"]
    per_head_row = 6 * text["hidden_size"] * text["vocab_size"]  # fwd + bwd per logits row
    _, pre = gpu_bench.preprocessed(args.work, args.scale, args.max_seq_len)
    rows = {}
    for path in sorted(glob.glob(os.path.join(pre, "stats", "part-*.parquet"))):
        for row in pq.read_table(path, columns=["sample_id", "image_tiles", "vit_tiles",
                                                "videos", "loss_tokens"]).to_pylist():
            rows[row["sample_id"]] = row
    with open(args.log, encoding="utf-8") as f:
        records = [json.loads(line) for line in f]
    squares = [counted_squares(record, rows) for record in records]
    peak = args.peak_tflops * 1e12
    print("| step | step s | logged model FLOPs | ViT attention FLOPs | head on unsupervised "
          "tokens | MFU logged | recounted | and causal attention as the full square |\n"
          "|---:|---:|---:|---:|---:|---:|---:|---:|")
    sums = {"seconds": 0.0, "logged": 0.0, "recounted": 0.0, "full": 0.0}
    for record, micro in zip(records, squares):
        extra = per_square * sum(n for n, already, _ in micro if not already)
        unsupervised = per_head_row * sum(u for _, _, u in micro)
        causal = per_causal * sum(m["squares"] for d in record["data"] for m in d["micro_sizes"])
        flops, seconds = record["model_flops"], record["step_time_s"]
        recounted = flops + extra - unsupervised
        if record["step"] >= args.warmup:
            for key, value in (("seconds", seconds), ("logged", flops),
                               ("recounted", recounted), ("full", recounted + causal)):
                sums[key] += value
        mfus = [f / seconds / peak for f in (flops, recounted, recounted + causal)]
        print(f"| {record['step']} | {seconds:.3f} | {flops:.4g} | {extra:.4g} | "
              f"{unsupervised:.4g} | " + " | ".join(f"{mfu:.1%}" for mfu in mfus) + " |")
    mfu = {k: v / sums["seconds"] / peak for k, v in sums.items() if k != "seconds"}
    print(f"MFU from step {args.warmup}, the steps' FLOPs over their time: {mfu['logged']:.1%} "
          f"logged, {mfu['recounted']:.1%} recounted (the ViT's attention in, the head on "
          f"supervised tokens), {mfu['full']:.1%} with causal attention as the full square too "
          "(Megatron-LM's, torchtitan's and llm-foundry's convention; gpu_bench.py's "
          "mfu_full_attention)")
    if args.replay:
        replay_both(args, records, squares)


def counted_squares(record: dict, rows: dict) -> list[tuple[int, bool, int]]:
    """Per micro-batch of a logged step (its first data-parallel rank's), the ViT's squared
    patch counts of its rebuilt samples, whether the log counts them already (its
    ``vit_squares``, then checked equal), and the tokens whose logits a log from before the
    supervised count charged beyond its supervised ones (0 for a log that has it). Exits
    where the samples do not hold the logged
    tiles: not this run's data."""
    data = record["data"][0] if isinstance(record["data"], list) else record["data"]
    out = []
    for ids, size in zip(data["sample_ids"], data["micro_sizes"]):
        tiles = sum(rows[i]["vit_tiles"] for i in ids)
        if tiles != size["tiles"]:
            sys.exit(f"step {record['step']}: the rebuilt samples hold {tiles} tiles, "
                     f"the log {size['tiles']}: not this run's data")
        rebuilt = sum(attention_squares(rows[i]) for i in ids)
        if size.get("vit_squares", rebuilt) != rebuilt:
            sys.exit(f"step {record['step']}: the log counts {size['vit_squares']} "
                     f"squared patches, the rebuilt samples hold {rebuilt}")
        unsupervised = 0 if "supervised" in size else size["tokens"] - sum(
            rows[i]["loss_tokens"] for i in ids)
        out.append((rebuilt, "vit_squares" in size, unsupervised))
    return out


def replay_both(args, records: list[dict],
                squares: list[list[tuple[int, bool, int]]]) -> None:
    """The simulator's replay per layer kind (``replay_run``, as gpu_bench.py runs it) of the
    logged steps as logged, and with each micro-batch's ``vit_squares`` in the log and in the
    profile's micro-batches (the profile's are the plan's first step's, matched by their
    tiles, tokens and squares): predicted against measured, step by step."""
    import shutil

    from vlmshard.io import read_json
    from vlmshard.simulate.replay import replay_run, step_seconds

    profile = read_json(os.path.join(args.replay, "profile.json"))
    # the profile's micro-batches: as logged (a new log's own count), and counted
    first = {(m["tiles"], m["tokens"], m["squares"]): {False: m.get("vit_squares", 0), True: n}
             for m, (n, _, _) in zip(records[0]["data"][0]["micro_sizes"], squares[0])}
    results = {}
    for name, count in (("as logged", False), ("ViT attention counted", True)):
        run = os.path.join(args.work, "replay", name.replace(" ", "-"))
        os.makedirs(run, exist_ok=True)
        shutil.copy(os.path.join(args.replay, "pipeline-balanced.json"),
                    os.path.join(run, "pipeline.json"))
        with open(os.path.join(run, "train_log.jsonl"), "w", encoding="utf-8") as f:
            for record, micro in zip(records, squares):
                record = copy.deepcopy(record)
                sizes = record["data"][0]["micro_sizes"]
                for size, (n, _, _) in zip(sizes, micro):
                    size["vit_squares"] = n if count else size.get("vit_squares", 0)
                f.write(json.dumps(record) + "\n")
        batches = [{**m, "vit_squares": first[(m["tiles"], m["tokens"], m["squares"])][count]}
                   for m in profile["micro_batches"]]
        with open(os.path.join(run, "profile.json"), "w", encoding="utf-8") as f:
            json.dump({**profile, "micro_batches": batches}, f)
        steps = step_seconds(replay_run(os.path.join(run, "train_log.jsonl"), run,
                                        per_kind=True))["per_step"]
        results[name] = {s["step"]: s for s in steps if s["step"] >= args.warmup}
    print("\n| step | measured s | " + " | ".join(f"replayed {n} (error)" for n in results)
          + " |\n|---:|---:|" + "---:|" * len(results))
    for step, base in results["as logged"].items():
        cells = [f"{r[step]['predicted_s']:.3f} s ({error(r[step]):+.1%})"
                 for r in results.values()]
        print(f"| {step} | {base['measured_s']:.3f} | " + " | ".join(cells) + " |")
    for name, r in results.items():
        print(f"{name}: median |error| "
              f"{statistics.median(abs(error(s)) for s in r.values()):.1%}")


def error(step: dict) -> float:
    """A replayed step's relative error against the measured."""
    return step["predicted_s"] / step["measured_s"] - 1


if __name__ == "__main__":
    main()
