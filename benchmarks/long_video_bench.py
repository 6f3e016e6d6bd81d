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
import shutil
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
    step or image, ``unit_squares`` its units' tiles²) and its media as ViT units."""
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
    owner = np.repeat(np.arange(n), np.diff(media.offsets))
    unit = media.tiles // media.units
    return (Lengths(np.bincount(owner, media.tiles, minlength=n).astype(np.int64), tokens,
                    kind.astype(np.int32), ("image", "images", "text", "clip"),
                    largest_units(media),
                    unit_squares=np.bincount(owner, media.units * unit.astype(float) ** 2,
                                             minlength=n)), media)


def largest_units(media: MediaUnits) -> np.ndarray:
    """Each sample's largest ViT unit in tiles (``Lengths.largest``; 0 without media)."""
    largest = np.zeros(len(media.offsets) - 1, np.int64)
    np.maximum.at(largest, np.repeat(np.arange(len(largest)), np.diff(media.offsets)),
                  media.tiles // media.units)
    return largest


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


def loader(args) -> dict:
    """``--loader``: shards of 1-minute clips (640x360 H.264, sampled at 2 fps to 120 frames
    of 448x448 at most: 60 steps of up to 196 tiles) for a tiny Qwen3-VL, planned at SP 1, 4
    and 8 over 8 ranks; per degree, what each rank reads (seconds and bytes, the record's
    whole) and decodes (seconds, frames) per micro-batch share, medians over every rank's, and
    the step time an H100 at 45% takes for that share at Qwen3-VL-8B's FLOPs
    (``hbp_bench.COST``), whence the bytes a second a node's 8 ranks read."""
    import statistics

    from PIL import Image

    from vlmshard.demo.clips import Clip, make_clip
    from vlmshard.families import tiny_folder
    from vlmshard.hardware import GPUS, SUSTAINED_SHARE
    from vlmshard.packing.config import PackConfig
    from vlmshard.packing.plan import run_pack
    from vlmshard.preprocess import PreprocessConfig, run_preprocess
    from vlmshard.shards.config import WriteConfig
    from vlmshard.shards.layout import read_manifest
    from vlmshard.shards.loader import ShardDataset
    from vlmshard.shards.writer import run_write

    work = os.path.abspath(args.work)
    os.makedirs(work, exist_ok=True)
    folder = tiny_folder("qwen3_vl", os.path.join(work, "model"), max_pixels=448 * 448 * 30,
                         text_sizes={"num_attention_heads": 8})  # SP 8 splits its heads
    clips = []
    for k, photo in enumerate(("astronaut.png", "coffee.png", "chelsea.png", "rocket.jpg")):
        path = os.path.join(work, f"clip{k}.mp4")
        if not os.path.exists(path):
            import skimage

            with Image.open(os.path.join(os.path.dirname(skimage.__file__), "data",
                                         photo)) as im:
                data = make_clip(im, Clip(frames=480, fps=8, width=640, height=360))
            with open(path, "wb") as f:
                f.write(data)
        clips.append(path)
    with open(os.path.join(work, "rows.jsonl"), "w") as f:
        for i in range(args.loader_clips):
            f.write(json.dumps({"videos": [clips[i % len(clips)]], "conversations": [
                {"from": "human", "value": f"<video>\nWhat happens in clip {i}?"},
                {"from": "gpt", "value": "The camera pans from left to right."}]}) + "\n")
    pre = os.path.join(work, "pre")
    for name in ("pre", "sp1-plan", "sp1-shards", "sp4-plan", "sp4-shards", "sp8-plan",
                 "sp8-shards"):  # a fresh run's outputs: its rows change with --loader-clips
        shutil.rmtree(os.path.join(work, name), ignore_errors=True)
    run_preprocess(PreprocessConfig(inputs=[os.path.join(work, "rows.jsonl")], out=pre,
                                    model=folder, workers=1))
    rate = GPUS["h100"].peak_flops * SUSTAINED_SHARE
    rows = {}
    for sp in (1, 4, 8):
        plan, shards = (os.path.join(work, f"sp{sp}-{k}") for k in ("plan", "shards"))
        run_pack(PackConfig(stats=pre, dp=8, out=plan, groups=f"{sp * 16384}:{sp}",
                            max_qt=16384, max_qv=16384, seed=args.seed))
        run_write(WriteConfig(plan=plan, stats=pre, out=shards, workers=1))
        manifest = read_manifest(shards)
        read_s, decode_s, frames, nbytes, step_s = [], [], [], [], []
        warm = ShardDataset(shards, 0, 8)
        warm.collate(next(warm.records()))  # first-use costs (imports, caches) untimed
        for w in range(8):  # every rank: its micro-batches, its share of each
            data = ShardDataset(shards, w, 8)
            records = data.records()
            while True:
                t0 = time.perf_counter()
                record = next(records, None)
                if record is None:
                    break
                t1 = time.perf_counter()
                batch = data.collate(record)
                decode_s.append(time.perf_counter() - t1)
                read_s.append(t1 - t0)
                nbytes.append(sum(map(len, record.images)))
                frames.append(2 * int(batch["image_grid_thw"][:, 0].sum()))  # 2 a step
                tokens = np.array(record.seq_lens)
                work_units = COST.cost(record.tiles, tokens.sum(), COST.squares(tokens).sum())
                step_s.append((work_units / sp + COST.sp_exchange(tokens.sum(), sp) / sp)
                              / rate)
            assert manifest.step_group(0)["sp"] == sp
        rows[sp] = {"micro_batches": len(read_s) // sp,
                    "node_gb_s": 8 * statistics.median(nbytes) / statistics.median(step_s) / 1e9,
                    "read_s": statistics.median(read_s),
                    "decode_s": statistics.median(decode_s),
                    "frames": statistics.median(frames),
                    "record_mb": statistics.median(nbytes) / 1e6,
                    "h100_step_s": statistics.median(step_s)}
    return rows


def plan_256(args) -> dict:
    """``--plan-256``: one rank's memory bound for a 256-frame clip at 448x448 (128 steps:
    25,088 tiles, 26,176 tokens) of Qwen3-VL-2B and -8B on an 80 GB H100, from the analytic
    memory model (``partition.largest_micro_batch``: bf16 weights, ZeRO-1 states over the 8
    ranks of a node, the ViT in one varlen call; the SP exchange's buffers not yet in it),
    without and with whole-layer recompute; and what ``--groups auto`` makes of it
    (``_clip_groups``)."""
    from gpu_bench import QWEN3_VL_2B
    from transformers import AutoConfig

    from vlmshard.families import model_sizes
    from vlmshard.hardware import GPUS
    from vlmshard.model_sizes import CostTerms, Saves, bytes_per_param, layer_work
    from vlmshard.partition import Machine, largest_micro_batch

    models = {"qwen3-vl-2b": model_sizes(AutoConfig.for_model(
        "qwen3_vl", text_config=dict(QWEN3_VL_2B["text_sizes"]), tie_word_embeddings=True,
        vision_config=dict(QWEN3_VL_2B["vision_sizes"], patch_size=16, spatial_merge_size=2,
                           temporal_patch_size=2)).to_dict(), "qwen3-vl-2b"),
        "qwen3-vl-8b": MODEL}
    steps = 128
    clip = CostTerms(steps * STEP_TILES, steps * STEP_TOKENS + 64)
    machine = Machine.for_device(GPUS["h100"].memory_bytes)
    ranks = 8
    out = {"clip": {"tiles": clip.tiles, "tokens": clip.tokens}}
    for name, config in models.items():
        work = layer_work(config, Saves(vit_one_call=True))
        out[name] = _clip_groups(config, {
            mode: largest_micro_batch(work, clip, machine, bytes_per_param("bf16", ranks),
                                      whole_recompute=whole)
            for mode, whole in (("recompute-free", False), ("whole recompute", True))},
            clip, ranks, args.seed)
    return out


def _clip_groups(config, bounds: dict, clip, ranks: int, seed: int) -> dict:
    """Per memory bound (one rank's), the groups ``--groups auto`` chooses for 8 clips of
    ``clip``'s size among 2,000 image chats, the SP degree of the clips' group, and the clips
    it leaves unplaced."""
    from vlmshard.packing.algorithms import Caps
    from vlmshard.packing.cost import CostModel

    out = {}
    short, _ = video_mix(2000, seed, clip_share=0.0)
    n = len(short) + 8
    lengths = Lengths(np.r_[short.tiles, [clip.tiles] * 8].astype(np.int64),
                      np.r_[short.tokens, [clip.tokens] * 8].astype(np.int64),
                      np.r_[short.source, [3] * 8].astype(np.int32), short.sources,
                      np.r_[short.largest, [STEP_TILES] * 8].astype(np.int64))
    refusal = lambda sp: sequence_parallel_refusal(config.llm, sp)  # noqa: E731
    cost = CostModel.from_sizes(config)
    for name, bound in bounds.items():
        rank = Caps(int(bound.tiles), int(bound.tokens))
        groups, _ = search_groups(lengths, rank, dp=ranks, ranks=ranks, micro_batches=1,
                                  seed=seed, cost=cost, mode=MODE, refusal=refusal)
        plan = pack_groups(lengths, np.arange(n, dtype=np.int64), groups, ranks=ranks,
                           micro_batches=1, seed=seed, cost=cost, mode=MODE, order="mixed")
        holder = next((g for g in groups if g.length >= clip.tokens and g.qv >= clip.tiles),
                      None)  # None: no degree up to ``ranks`` holds it
        out[name] = {"rank_qv": rank.qv, "rank_qt": rank.qt,
                     "groups": [f"{g.length}:{g.sp}" for g in groups],
                     "clip_sp": holder and holder.sp,
                     "clips_unplaced": int((lengths.source[plan.unplaced] == 3).sum())}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=50_000)
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--clip-share", type=float, default=0.075)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="also write the figures here")
    parser.add_argument("--loader", action="store_true",
                        help="instead: each rank's read and decode of a long-clip group at SP "
                             "1, 4 and 8 against an H100's step (a few minutes)")
    parser.add_argument("--loader-clips", type=int, default=16)
    parser.add_argument("--work", default="build/long-video", help="--loader's folder")
    parser.add_argument("--plan-256", action="store_true",
                        help="instead: the SP degree a 256-frame Qwen3-VL-2B clip takes on an "
                             "80 GB H100 by the memory model")
    args = parser.parse_args()
    if args.plan_256:
        result = plan_256(args)
        print(json.dumps(result, indent=1))
        return
    if args.loader:
        rows = loader(args)
        print(f"Command: `python benchmarks/long_video_bench.py {' '.join(sys.argv[1:])}`; "
              f"{platform.node()}, one process.\n")
        print("| SP | micro-batches | record (MB, read by each rank) | read (s) | decode a share "
              "(s) | frames decoded | H100 step a share (s) | decode / step | a node's 8 "
              "ranks read (GB/s) |")
        print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for sp, r in rows.items():
            print(f"| {sp} | {r['micro_batches']} | {r['record_mb']:.1f} | {r['read_s']:.3f} | "
                  f"{r['decode_s']:.3f} | {r['frames']:.0f} | {r['h100_step_s']:.3f} | "
                  f"{r['decode_s'] / r['h100_step_s']:.2f} | {r['node_gb_s']:.2f} |")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"command": " ".join(sys.argv), "rows": rows}, f, indent=1)
        return
    lengths, media = video_mix(args.samples, args.seed, args.clip_share)
    before = Lengths(lengths.tiles, lengths.tokens, lengths.source, lengths.sources,
                     largest_units(whole(media)), unit_squares=lengths.unit_squares)
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
