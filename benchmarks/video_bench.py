"""Videos in the mix: packing balance with 10% video samples, and the cost of probing a clip.

    python benchmarks/video_bench.py                 # everything (about 3 minutes)
    python benchmarks/video_bench.py --samples 2000  # a quick look

Packing: a synthetic Qwen2-VL mix (20,000 samples by default: 20% text only, 62% one image, 8%
two to four images, 10% one video), costed as Qwen2-VL-2B; each sample's tiles and tokens come
from the family's own rules (``Qwen2VLTiling.tiles`` for images; ``sample_video`` for videos:
2 fps, the video processor's default per-frame pixel limit and total budget), drawn from the
distributions stated in ``video_mix`` (each image and video step's tiles² too: Qwen2-VL's ViT
attends across each, ``CostModel.a_vs``); samples over 32,768 tokens are left out, as
``--max-seq-len 32768`` would reject them. Packed by ``random``, ``isf`` (OmniBal's caps search:
its unplaced samples shown), ``isf`` at ``balanced``'s caps and ``balanced`` (automatic caps),
R=8, M=1 and M=4, on the mix and on its 90% without videos: step_efficiency and the
distribution ratios side by side.

Probe: clips made with ``preprocess/clips.py`` (H.264 MP4, 640×360 at 30 fps, 5/20/60 s),
``read_video_header`` (header, every packet demuxed, the first frame decoded) against decoding
every frame with PyAV, in this one process (one core); medians of repeats. Also the bytes a
clip's sampled frames take in a shard (lossless PNG, as ``vlmshard write`` stores them) against
the clip's own bytes.
Prints Markdown for BENCHMARKS.md; ``--json`` also writes the numbers.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import statistics
import sys
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from pack_bench import plan  # noqa: E402  (caps + one epoch + metrics, as vlmshard pack)

from vlmshard.families import presets  # noqa: E402
from vlmshard.families.qwen2vl import Qwen2VLTiling  # noqa: E402
from vlmshard.packing.batches import Lengths  # noqa: E402
from vlmshard.packing.cost import CostModel  # noqa: E402

COST = CostModel.from_sizes(presets()["qwen2-vl-2b"])
POLICY = Qwen2VLTiling()  # transformers' defaults: images up to 1280 tokens, video 2 fps
MAX_SEQ_LEN = 32768
IMAGE_SIZES = ((640, 480), (1024, 768), (448, 448), (1280, 720), (800, 1200), (1700, 2200),
               (336, 252), (1920, 1080))
VIDEO_SIZES = ((640, 360), (854, 480), (1280, 720), (1920, 1080))
METRICS = ("step_efficiency", "vit_dist_ratio", "llm_dist_ratio", "attn_dist_ratio", "qv", "qt",
           "steps", "unplaced")


def video_mix(n: int, seed: int = 0) -> tuple[Lengths, dict]:
    """(lengths, what was drawn): text tokens lognormal (median 150, σ 1.0, 8..4096); image
    sizes uniform over ``IMAGE_SIZES`` scaled by 0.5..1.5; clips lognormal in duration (median
    20 s, σ 0.9, 2..300 s) at 24/25/30 fps, sizes uniform over ``VIDEO_SIZES``."""
    rng = np.random.default_rng(seed)
    kind = rng.choice(4, size=n, p=[0.20, 0.62, 0.08, 0.10])  # text, image, images, video
    text = np.clip(np.round(rng.lognormal(np.log(150), 1.0, n)), 8, 4096).astype(np.int64)
    tiles = np.zeros(n, np.int64)
    unit_squares = np.zeros(n)  # Σ tiles² over each image and video step: the ViT attends there
    video_tokens = []
    for i in range(n):
        if kind[i] in (1, 2):
            for _ in range(1 if kind[i] == 1 else int(rng.integers(2, 5))):
                w, h = IMAGE_SIZES[rng.integers(len(IMAGE_SIZES))]
                scale = rng.uniform(0.5, 1.5)
                image = POLICY.tiles(int(w * scale), int(h * scale), 1)
                tiles[i] += image
                unit_squares[i] += image ** 2
        elif kind[i] == 3:
            seconds = float(np.clip(rng.lognormal(np.log(20), 0.9), 2, 300))
            fps = float(rng.choice([24, 25, 30]))
            w, h = VIDEO_SIZES[rng.integers(len(VIDEO_SIZES))]
            video = POLICY.sample_video(int(seconds * fps), fps, w, h)
            tiles[i] = video.tiles
            steps = video.grid[0]
            unit_squares[i] = steps * (video.tiles // steps) ** 2
            video_tokens.append(video.tokens)
    tokens = tiles + text  # one LLM token per merged patch
    keep = tokens <= MAX_SEQ_LEN
    drawn = {"samples": int(keep.sum()), "videos": int((kind[keep] == 3).sum()),
             "too_long": int((~keep).sum()),
             "video_tokens_median": int(np.median(video_tokens)),
             "video_tokens_p90": int(np.percentile(video_tokens, 90)),
             "image_sample_tokens_median": int(np.median(tokens[(kind == 1) & keep]))}
    lengths = Lengths(tiles[keep], tokens[keep], (kind[keep] == 3).astype(np.int32),
                      ("images-and-text", "video"), unit_squares=unit_squares[keep])
    return lengths, drawn


def packing(n: int) -> dict:
    lengths, drawn = video_mix(n)
    plan(lengths.take(np.arange(min(2000, len(lengths)))), "balanced", 8, 1, cost=COST)  # JIT
    without = lengths.take(np.flatnonzero(lengths.source == 0))
    out = {"mix": drawn, "runs": {}}
    for micro in (1, 4):
        for name, data in (("with video", lengths), ("without video", without)):
            runs = {algo: plan(data, algo, 8, micro, cost=COST).to_dict()
                    for algo in ("random", "isf", "balanced")}
            caps = {"qv": runs["balanced"]["qv"], "qt": runs["balanced"]["qt"]}
            runs["isf at balanced's caps"] = plan(data, "isf", 8, micro, cost=COST,
                                                  **caps).to_dict()
            for algo, m in runs.items():
                out["runs"][f"M={micro} {name} {algo}"] = {k: m[k] for k in METRICS}
    return out


def probe(repeats: int, lengths: tuple[int, ...] = (5, 20, 60)) -> dict:
    import av
    from PIL import Image
    from skimage import data

    from vlmshard.demo.clips import Clip, make_clip
    from vlmshard.preprocess.videos import read_video_header, sampled_frames

    photo = Image.fromarray(data.astronaut())
    out = {}
    for seconds in lengths:
        clip = make_clip(photo, Clip(frames=30 * seconds, fps=30, width=640, height=360))

        def decode_all() -> int:
            with av.open(io.BytesIO(clip)) as container:
                return sum(1 for _ in container.decode(video=0))

        timings = {"probe": [], "decode_all": []}
        for _ in range(repeats):
            for name, fn in (("probe", lambda: read_video_header("clip.mp4", clip)),
                             ("decode_all", decode_all)):
                t0 = time.perf_counter()
                fn()
                timings[name].append(time.perf_counter() - t0)
        header = read_video_header("clip.mp4", clip)
        sampled = POLICY.sample_video(header.frames, header.fps, header.width, header.height)
        pngs = 0
        for frame in sampled_frames(clip, list(sampled.indices), "clip.mp4"):
            buf = io.BytesIO()
            frame.save(buf, format="PNG", compress_level=1)  # as vlmshard write stores frames
            pngs += len(buf.getvalue())
        probe_s, decode_s = (statistics.median(timings[k]) for k in ("probe", "decode_all"))
        out[f"{seconds} s"] = {"frames": header.frames, "clip_bytes": len(clip),
                               "probe_ms": 1e3 * probe_s, "decode_all_ms": 1e3 * decode_s,
                               "probe_videos_per_s": 1 / probe_s,
                               "decode_all_videos_per_s": 1 / decode_s,
                               "sampled_frames": len(sampled.indices), "png_bytes": pngs}
    return out


def markdown(results: dict) -> str:
    mix = results["packing"]["mix"]
    lines = [f"Mix: {mix['samples']:,} samples ({mix['videos']:,} with a video; "
             f"{mix['too_long']} over {MAX_SEQ_LEN:,} tokens left out); a video's tokens: "
             f"median {mix['video_tokens_median']:,}, p90 {mix['video_tokens_p90']:,}; a one-image "
             f"sample's: median {mix['image_sample_tokens_median']:,}.", "",
             "| run | " + " | ".join(METRICS) + " |", "|" + "---|" * (len(METRICS) + 1)]
    for name, m in results["packing"]["runs"].items():
        cells = [f"{m[k]:.4f}" if isinstance(m[k], float) else f"{m[k]:,}" for k in METRICS]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "| clip (640×360, 30 fps, H.264) | frames | probe ms | decode all ms | "
                  "probe videos/s | decode videos/s | ratio | clip bytes | sampled frames | "
                  "PNG bytes |", "|" + "---|" * 10]
    for name, p in results["probe"].items():
        lines.append(f"| {name} | {p['frames']} | {p['probe_ms']:.1f} | {p['decode_all_ms']:.1f} | "
                     f"{p['probe_videos_per_s']:.1f} | {p['decode_all_videos_per_s']:.2f} | "
                     f"{p['decode_all_ms'] / p['probe_ms']:.1f}× | {p['clip_bytes']:,} | "
                     f"{p['sampled_frames']} | {p['png_bytes']:,} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--samples", type=int, default=20000, help="samples in the packing mix")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats per clip (median)")
    p.add_argument("--clips", default="5,20,60", help="the probed clips' lengths in seconds")
    p.add_argument("--json", help="also write the numbers here")
    args = p.parse_args()
    results = {"machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python "
                          f"{platform.python_version()}",
               "command": "python benchmarks/video_bench.py " + " ".join(sys.argv[1:]),
               "packing": packing(args.samples),
               "probe": probe(args.repeats, tuple(int(c) for c in args.clips.split(",")))}
    print(markdown(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
