"""Long video across sequence-parallel groups: clips dealt by temporal step against clips dealt
whole, on a mix of short image chats and 1- to 10-minute clips.

    python benchmarks/long_video_bench.py               # about two minutes
    python benchmarks/long_video_bench.py --json out.json

The mix (``video_mix``, seeded): 75% single-image chats, 10% chats of 2-4 images, 7.5%
text-only chats and 7.5% clips of 1 to 10 minutes (log-uniform), at Qwen3-VL-8B's units (one
ViT tile = one merged 32-px patch = one LLM token). Images of 64 to 1,280 tiles; clips sampled
as Qwen3-VL's video processor does (2 fps, at most 768 frames, two frames a temporal step) at
448x448 a frame, the per-frame budget long-video recipes set (196 tiles a step, 8 timestamp and
wrapper tokens a step); chats of 32 to 1,024 text tokens.

The same samples, 64 ranks, one rank holding 8,192 tiles and tokens, and Qwen3-VL-8B's cost
model (``hbp_bench``'s) in three plans:

- ``clips whole``: each medium one ViT unit, as vlmshard dealt media before: a clip over one
  rank's tiles is unplaced, whatever the group's SP degree;
- ``clips by step``: each temporal step one unit (``Lengths.largest`` the largest step), the
  groups searched by ``--groups auto``;
- ``one cap``: one group at the longest length (the SP degree that holds it), units by step.

Per plan: the groups, samples and clips unplaced, the predicted epoch (``hbp_bench.figures``),
and per group of SP > 1 the ViT's balance over its ranks (``packing.groups.rank_balance``: Σ
fullest rank / Σ mean rank) as the loader deals it, beside the balance the same micro-batches
would have with each clip whole on one rank. Prints Markdown for BENCHMARKS.md.
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
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from hbp_bench import COST, MODE, MODEL, RANK, figures  # noqa: E402

from vlmshard.model_sizes import sequence_parallel_refusal  # noqa: E402
from vlmshard.packing.batches import Lengths, MediaUnits  # noqa: E402
from vlmshard.packing.groups import ladder, pack_groups, rank_balance, search_groups  # noqa: E402

STEP_TILES = (448 // 32) ** 2  # a 448x448 frame pair at Qwen3-VL's 16-px patches, 2x2 merged
STEP_TOKENS = STEP_TILES + 8  # its timestamp "<t seconds>" and vision start/end tokens
FPS, MAX_FRAMES = 2.0, 768  # Qwen3-VL's video processor defaults


def video_mix(n: int, seed: int, clip_share: float = 0.075) -> tuple[Lengths, MediaUnits]:
    """The module docstring's mix: each sample's lengths (``largest`` its largest temporal
    step or image) and its media as ViT units."""
    rng = np.random.default_rng(seed)
    kind = rng.choice(4, n, p=[0.75, 0.10, 0.075 + 0.075 - clip_share, clip_share])
    tiles, units, offsets, tokens = [], [], [0], np.zeros(n, np.int64)
    text = np.exp(rng.uniform(np.log(32), np.log(1024), n)).astype(np.int64)
    for i, k in enumerate(kind):
        if k == 3:  # a clip
            frames = min(int(np.exp(rng.uniform(np.log(60), np.log(600)))) * int(FPS),
                         MAX_FRAMES)
            steps = frames // 2
            tiles.append(steps * STEP_TILES)
            units.append(steps)
            tokens[i] = steps * STEP_TOKENS
        elif k < 2:  # one image, or 2-4
            for _ in range(1 if k == 0 else int(rng.integers(2, 5))):
                tiles.append(int(np.exp(rng.uniform(np.log(64), np.log(1280)))))
                units.append(1)
                tokens[i] += tiles[-1] + 2
        offsets.append(len(tiles))
        tokens[i] += text[i]
    media = MediaUnits(np.array(offsets), np.array(tiles, np.int64), np.array(units, np.int64))
    per_sample = np.add.reduceat(np.r_[media.tiles, 0], media.offsets[:-1])
    per_sample[np.diff(media.offsets) == 0] = 0
    unit = media.tiles // media.units
    largest = np.zeros(n, np.int64)
    np.maximum.at(largest, np.repeat(np.arange(n), np.diff(media.offsets)), unit)
    return (Lengths(per_sample, tokens, kind.astype(np.int32),
                    ("image", "images", "text", "clip"), largest), media)


def whole(media: MediaUnits) -> MediaUnits:
    """The same media, each one unit: a clip dealt whole."""
    return MediaUnits(media.offsets, media.tiles, np.ones_like(media.units))


def plan_rows(lengths: Lengths, media: MediaUnits, groups, ranks: int, seed: int) -> dict:
    ids = np.arange(len(lengths), dtype=np.int64)
    plan = pack_groups(lengths, ids, groups, ranks=ranks, micro_batches=1, seed=seed,
                       cost=COST, mode=MODE, order="mixed")
    row = figures(lengths, plan, ranks)
    row["clips_unplaced"] = int((lengths.source[plan.unplaced] == 3).sum())
    row["tokens_placed"] = 1 - lengths.tokens[plan.unplaced].sum() / lengths.tokens.sum()
    row["balance"] = []
    for group, packing in zip(plan.groups, plan.packings):
        if group.sp > 1 and packing.n_micro:
            row["balance"].append({
                "group": f"{group.length}:{group.sp}", "micro_batches": packing.n_micro,
                "vit_by_step": rank_balance(packing, media, lengths, group.sp)[0],
                "vit_clips_whole": rank_balance(packing, whole(media), lengths, group.sp)[0]})
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=50_000)
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--clip-share", type=float, default=0.075)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    lengths, media = video_mix(args.samples, args.seed, args.clip_share)
    before = Lengths(lengths.tiles, lengths.tokens, lengths.source, lengths.sources,
                     np.maximum.reduceat(np.r_[media.tiles, 0], media.offsets[:-1]) *
                     (np.diff(media.offsets) > 0))
    refusal = lambda sp: sequence_parallel_refusal(MODEL.llm, sp)  # noqa: E731
    common = {"dp": args.ranks, "ranks": args.ranks, "micro_batches": 1, "seed": args.seed,
              "cost": COST, "mode": MODE, "refusal": refusal}
    rows, seconds = {}, {}
    for name, data, units in (("clips whole", before, whole(media)),
                              ("clips by step", lengths, media)):
        t0 = time.perf_counter()
        groups, _ = search_groups(data, RANK, **common)
        rows[name] = plan_rows(data, units, groups, args.ranks, args.seed)
        seconds[name] = time.perf_counter() - t0
    one = (ladder(lengths, RANK, args.ranks, refusal)[-1],)
    rows["one cap"] = plan_rows(lengths, media, one, args.ranks, args.seed)
    clips = int((lengths.source == 3).sum())
    command = "python benchmarks/long_video_bench.py " + " ".join(sys.argv[1:])
    print(f"Command: `{command.strip()}`; {platform.node()}, {platform.processor() or 'cpu'}; "
          f"{args.samples:,} samples (seed {args.seed}) of which {clips:,} clips "
          f"({lengths.tokens[lengths.source == 3].min():,} to "
          f"{lengths.tokens[lengths.source == 3].max():,} tokens), {args.ranks} ranks, one rank "
          f"{RANK.qt} tiles and tokens; search and pack "
          + ", ".join(f"{k} {v:.0f} s" for k, v in seconds.items()) + ".\n")
    best = rows["clips by step"]["epoch_minutes"]
    print("| plan | groups (length:SP) | unplaced (clips) | tokens placed | predicted epoch "
          "(min, 64 H100s at 45%) | × by step | step_efficiency | steps |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for name, r in rows.items():
        print(f"| {name} | {', '.join(r['groups'])} | {r['unplaced']} ({r['clips_unplaced']}) "
              f"| {r['tokens_placed']:.1%} | {r['epoch_minutes']:.1f} | "
              f"{r['epoch_minutes'] / best:.2f} | "
              f"{r['step_efficiency']:.4f} | {r['steps']} |")
    print("\n| plan | group | micro-batches | ViT max/mean rank, by step | clips whole |")
    print("|---|---|---:|---:|---:|")
    for name, r in rows.items():
        for b in r["balance"]:
            print(f"| {name} | {b['group']} | {b['micro_batches']} | {b['vit_by_step']:.3f} | "
                  f"{b['vit_clips_whole']:.3f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": command, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
