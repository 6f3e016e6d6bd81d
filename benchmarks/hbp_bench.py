"""Hierarchical Balance Packing: packing groups with sequence parallelism against one cap.

    python benchmarks/hbp_bench.py                 # about a minute
    python benchmarks/hbp_bench.py --json out.json
    python benchmarks/hbp_bench.py --measure       # a scaled-down run through vlmshard train

A long-tail mix (``long_tail``, seeded): 80% short samples (single images and chats, 256 tokens
to 4k), 15% documents (several pages, 4k to 16k) and 5% video clips (16k to 64k), each media
token one ViT unit (Qwen's: a merged patch). The same samples, ranks and cost model (Qwen3-VL-8B's
FLOPs and its Ulysses exchange priced at an H100's NVLink, ``packing.cost``; its heads split
over SP 8, Qwen2-VL-2B's 12 do not) in four plans, one rank holding at most 8,192 tokens
(``--max-qt``):

- ``groups auto, balanced``: ``vlmshard pack --groups auto`` (levels and SP degrees searched);
- ``one cap 64k, balanced``: one group at the longest length, SP 8 for every step, packed with
  ``balanced`` (what ``vlmshard pack`` gives with a single group at 65,536 tokens);
- ``one cap 64k, greedy``: the same cap packed as HBP's naive baseline does, samples in random
  order cut greedily into micro-batches, dealt to ranks at random (OmniBal's ISF grouping, one
  pass);
- ``groups auto, greedy``: the groups with the same naive packing inside each.

Figures per plan: the predicted epoch time (Σ over steps of the slowest rank's executed work,
SP exchange included, at 45% of an H100's bf16 peak), step_efficiency, ABR (attn_dist_ratio), CR
(communication_ratio), and the ratio of each baseline's epoch time to the grouped plan's. Prints
Markdown for BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from vlmshard.families import presets  # noqa: E402
from vlmshard.hardware import GPUS, SUSTAINED_SHARE  # noqa: E402
from vlmshard.model_sizes import sequence_parallel_refusal  # noqa: E402
from vlmshard.packing import algorithms  # noqa: E402
from vlmshard.packing.algorithms import Caps  # noqa: E402
from vlmshard.packing.batches import Lengths  # noqa: E402
from vlmshard.packing.cost import CostModel  # noqa: E402
from vlmshard.packing.groups import (  # noqa: E402
    GroupedPacking,
    assign,
    ladder,
    order_steps,
    pack_groups,
    search_groups,
)

MODEL = presets()["qwen3-vl-8b"]  # 32 query and 8 key/value heads: SP up to 32 splits them
COST = CostModel.from_sizes(MODEL)
RANK = Caps(8192, 8192)  # one rank's tiles and tokens
MODE = "padding-free"


def long_tail(n: int, seed: int) -> Lengths:
    """The module docstring's mix: log-uniform lengths within each class, media tokens
    (= ViT units) 90% of a short sample's tokens, 95% of a document's or a clip's."""
    rng = np.random.default_rng(seed)
    kind = rng.choice(3, n, p=[0.80, 0.15, 0.05])
    low = np.array([256, 4096, 16384])[kind]
    high = np.array([4096, 16384, 65536])[kind]
    tokens = np.exp(rng.uniform(np.log(low), np.log(high))).astype(np.int64)
    media = np.array([0.90, 0.95, 0.95])[kind]
    return Lengths((tokens * media).astype(np.int64), tokens, kind.astype(np.int32),
                   ("short", "document", "clip"))


def greedy(lengths: Lengths, ids: np.ndarray, groups, *, ranks: int, micro_batches: int,
           seed: int) -> GroupedPacking:
    """HBP's naive packing in each group: random order, greedy cuts (ISF's grouping, one pass),
    micro-batches dealt to ranks at random."""
    where = assign(lengths, ids, groups)
    packings = []
    for g, group in enumerate(groups):
        mine = ids[where == g]
        items, cut = algorithms.isf_groups(lengths, mine, group.caps, seed=seed, iterations=1)
        packings.append(algorithms.deal_groups(items, cut, ranks=ranks // group.sp,
                                               micro_batches=micro_batches, seed=seed))
    over = ids[where < 0]
    return GroupedPacking(tuple(groups), packings, order_steps([p.steps for p in packings],
                                                               "mixed"),
                          np.r_[over, np.concatenate([p.unplaced for p in packings])],
                          [])


def figures(lengths: Lengths, plan: GroupedPacking, ranks: int) -> dict:
    whole, _ = plan.measure(lengths, COST, ranks, MODE)
    # the executed work of the epoch over the ranks' FLOP rate, from step_efficiency:
    # spent = useful / step_efficiency, useful the placed samples' cost
    placed = np.concatenate([p.items for p in plan.packings])
    useful = float(COST.cost(lengths.tiles[placed].sum(), lengths.tokens[placed].sum(),
                             COST.squares(lengths.tokens[placed]).sum()))
    rate = ranks * GPUS["h100"].peak_flops * SUSTAINED_SHARE
    return {"groups": [f"{g.length}:{g.sp}" for g in plan.groups],
            "epoch_minutes": useful / whole.step_efficiency / rate / 60,
            "step_efficiency": whole.step_efficiency, "abr": whole.attn_dist_ratio,
            "cr": whole.communication_ratio, "steps": whole.steps, "samples": whole.samples,
            "unplaced": len(plan.unplaced)}


def measure(args) -> dict:
    """``--measure``: a scaled-down long-tail mix through the real stages and ``vlmshard train``
    (4 CPU processes, gloo), grouped (``--groups auto``) against one cap at the longest length,
    same ranks: each plan's step_efficiency (the predicted ratio) and its measured epoch and
    median step time. Text-only chats of a tiny Qwen3-VL (hidden 256, 4 layers); one rank holds
    240 tokens, so the longest samples (up to 960) take SP 4."""
    import statistics
    import subprocess

    from vlmshard.families import tiny_folder
    from vlmshard.io import read_json
    from vlmshard.packing.config import PackConfig
    from vlmshard.packing.plan import run_pack
    from vlmshard.preprocess import PreprocessConfig, run_preprocess
    from vlmshard.shards.config import WriteConfig
    from vlmshard.shards.writer import run_write

    work = os.path.abspath(args.work)
    os.makedirs(work, exist_ok=True)
    folder = tiny_folder("qwen3_vl", os.path.join(work, "model"), text_sizes=dict(
        hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=4, head_dim=32), vision_sizes=dict(out_hidden_size=256))
    rng = np.random.default_rng(args.seed)
    words = ["the", "cat", "sat", "on", "a", "mat", "and", "looked", "at", "sky"]
    with open(os.path.join(work, "rows.jsonl"), "w") as f:
        for i in range(args.measure_samples):
            kind = rng.choice(3, p=[0.80, 0.15, 0.05])
            low, high = ((8, 25), (25, 110), (110, 450))[kind]
            n = int(np.exp(rng.uniform(np.log(low), np.log(high))))
            answer = " ".join(rng.choice(words, n))
            f.write(json.dumps({"conversations": [{"from": "human", "value": f"Tell {i}."},
                                                  {"from": "gpt", "value": answer}]}) + "\n")
    pre = os.path.join(work, "pre")
    run_preprocess(PreprocessConfig(inputs=[os.path.join(work, "rows.jsonl")], out=pre,
                                    model=folder, workers=1))
    rank_tokens, dp = 240, 4
    rows = {}
    for name, groups in (("groups auto", "auto"), ("one cap", f"{dp * rank_tokens}:{dp}")):
        slug = name.replace(" ", "-")
        plan, shards, run = (os.path.join(work, f"{slug}-{k}") for k in ("plan", "shards",
                                                                          "run"))
        packed = run_pack(PackConfig(stats=pre, dp=dp, out=plan, groups=groups,
                                     max_qt=rank_tokens, max_qv=1, seed=args.seed))
        run_write(WriteConfig(plan=plan, stats=pre, out=shards, workers=1))
        subprocess.run([sys.executable, "-m", "vlmshard.cli", "train", "--shards", shards,
                        "--pp", "1", "--dp", str(dp), "--out", run, "--lr", "0.001"],
                       check=True, capture_output=True)
        with open(os.path.join(run, "train_log.jsonl")) as f:
            log = [json.loads(line) for line in f]
        times = [r["step_time_s"] for r in log[1:]]  # the first is the warm-up
        rows[name] = {"groups": [f"{g['length']}:{g['sp']}" for g in read_json(
                          os.path.join(plan, "plan.json"))["groups"]],
                      "step_efficiency": packed.metrics.step_efficiency,
                      "cr": packed.metrics.communication_ratio, "steps": len(log),
                      "epoch_s": sum(times), "median_step_s": statistics.median(times),
                      "sp_steps": {sp: sum(r["sp"] == sp for r in log)
                                   for sp in sorted({r["sp"] for r in log})}}
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=200_000)
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--micro-batches", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="also write the figures here")
    parser.add_argument("--measure", action="store_true",
                        help="instead: a scaled-down mix trained on CPU, grouped against one "
                             "cap, predicted and measured (a few minutes)")
    parser.add_argument("--measure-samples", type=int, default=600)
    parser.add_argument("--work", default="build/hbp-measure", help="--measure's folder")
    args = parser.parse_args()
    if args.measure:
        rows = measure(args)
        print(f"Command: `python benchmarks/hbp_bench.py {' '.join(sys.argv[1:])}`; "
              f"{platform.node()}, 4 CPU processes (gloo).\n")
        print("| plan | groups (length:SP) | steps (by SP) | step_efficiency | measured epoch "
              "(s, steps 1..) | median step (s) |")
        print("|---|---|---|---:|---:|---:|")
        for name, r in rows.items():
            print(f"| {name} | {', '.join(r['groups'])} | {r['steps']} ({r['sp_steps']}) | "
                  f"{r['step_efficiency']:.4f} | {r['epoch_s']:.1f} | "
                  f"{r['median_step_s']:.3f} |")
        a, b = rows["groups auto"], rows["one cap"]
        print(f"\nOne cap over groups: predicted {a['step_efficiency'] / b['step_efficiency']:.2f}"
              f"x, measured {b['epoch_s'] / a['epoch_s']:.2f}x (epoch time).")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"command": " ".join(sys.argv), "rows": rows}, f, indent=1)
        return
    lengths = long_tail(args.samples, args.seed)
    ids = np.arange(len(lengths), dtype=np.int64)
    common = {"ranks": args.ranks, "micro_batches": args.micro_batches, "seed": args.seed}
    whole = {"cost": COST, "mode": MODE, "order": "mixed"}
    t0 = time.perf_counter()
    refusal = lambda sp: sequence_parallel_refusal(MODEL.llm, sp)  # noqa: E731
    groups, tried = search_groups(lengths, RANK, dp=args.ranks, cost=COST, mode=MODE,
                                  refusal=refusal, **common)
    search_s = time.perf_counter() - t0
    one = (ladder(lengths, RANK, args.ranks, refusal)[-1],)
    plans = {
        "groups auto, balanced": pack_groups(lengths, ids, groups, **whole, **common),
        "one cap, balanced": pack_groups(lengths, ids, one, **whole, **common),
        "one cap, greedy": greedy(lengths, ids, one, **common),
        "groups auto, greedy": greedy(lengths, ids, groups, **common),
    }
    rows = {name: figures(lengths, plan, args.ranks) for name, plan in plans.items()}
    best = rows["groups auto, balanced"]["epoch_minutes"]
    command = "python benchmarks/hbp_bench.py " + " ".join(sys.argv[1:])
    print(f"Command: `{command.strip()}`; {platform.node()}, {platform.processor() or 'cpu'}; "
          f"{args.samples:,} samples (seed {args.seed}), {args.ranks} ranks, one rank "
          f"{RANK.qt} tokens; group search {search_s:.1f} s over {len(tried)} candidates.\n")
    print("| plan | groups (length:SP) | predicted epoch (min, H100s at 45%) | × grouped | "
          "step_efficiency | ABR | CR | steps | unplaced |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, r in rows.items():
        print(f"| {name} | {', '.join(r['groups'])} | {r['epoch_minutes']:.1f} | "
              f"{r['epoch_minutes'] / best:.2f} | {r['step_efficiency']:.4f} | {r['abr']:.4f} | "
              f"{r['cr']:.3f} | {r['steps']} | {r['unplaced']} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": command, "rows": rows, "tried": tried}, f, indent=1)


if __name__ == "__main__":
    main()
