"""Shard write throughput and loader throughput against a plain webdataset pipeline.

    python benchmarks/shards_bench.py                  # about 6 minutes on 2 vCPUs

Data: the demo dataset (scikit-image photos cut to many sizes, up to 4096x3072 PNG/JPEG) at
``--scale``, preprocessed with kept tokens and packed ``balanced`` for one rank, so every tar is
read by a single rank's loader.

- Write: ``run_write`` with 1 and 2 workers into fresh folders; MB/s of tar bytes written.
- Load: micro-batches/s of ``make_loader`` (checks: per-member CRC-32, streaming sha256 of every
  shard, record order, image-token counts, tile counts) against a plain ``webdataset.WebDataset``
  pipeline over the same tars doing the same decoding work (json, npy, PIL decode, the same
  tiling and normalization, padding to Qt/Qv) with none of the checks, both through a
  ``DataLoader`` with 0, 1 and 2 workers. Runs alternate ours/plain; medians of ``--repeats``.
  The first micro-batch of each run (worker start-up) is not timed.
- Reads per worker: bytes each of K loader workers reads (the kernel's ``rchar``) and its
  seconds, when it seeks to its own records through the manifest's offsets against when it
  streams the rank's shards whole and keeps every K-th record (what a ``pipe:`` or curl stream
  still does). Records only, no image decoding, so the difference is the I/O.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import shutil
import statistics
import sys
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import torch  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from vlmshard.packing.config import PackConfig  # noqa: E402
from vlmshard.packing.plan import run_pack  # noqa: E402
from vlmshard.preprocess import PreprocessConfig, run_preprocess  # noqa: E402
from vlmshard.demo.data import generate  # noqa: E402
from vlmshard.preprocess.tokenize import IGNORE_INDEX  # noqa: E402
from vlmshard.shards.layout import join, read_manifest  # noqa: E402
from vlmshard.families import to_rgb  # noqa: E402
from vlmshard.shards.loader import ShardDataset, make_loader  # noqa: E402
from vlmshard.shards.config import WriteConfig  # noqa: E402
from vlmshard.shards.writer import run_write  # noqa: E402


def prepare(work: str, scale: int) -> tuple[str, str]:
    shutil.rmtree(work, ignore_errors=True)  # scratch: regenerated data would not resume
    data = generate(os.path.join(work, "data"), seed=0, scale=scale)
    pre = os.path.join(work, "preprocess")
    run_preprocess(PreprocessConfig(inputs=[data.meta], out=pre, keep_tokens=True,
                                    max_seq_len=8192, part_size=256))
    plan = os.path.join(work, "plan")
    run_pack(PackConfig(stats=pre, dp=1, out=plan))
    return pre, plan


def bench_write(work: str, pre: str, plan: str, workers: int, shard_bytes: str) -> dict:
    out = os.path.join(work, f"shards-w{workers}")
    shutil.rmtree(out, ignore_errors=True)
    result = run_write(WriteConfig(plan=plan, stats=pre, out=out, workers=workers,
                                   shard_bytes=shard_bytes))
    return {"workers": workers, "bytes": result.bytes, "seconds": result.seconds,
            "mb_per_s": result.bytes / 1e6 / result.seconds, "shards": result.shards, "out": out}


def plain_webdataset(root: str):
    """The baseline: webdataset's own pipeline, same decode/tile/pad work, no checks."""
    import msgpack
    import webdataset as wds
    from PIL import Image

    manifest = read_manifest(root)
    policies = manifest.policies()
    first = next(iter(policies.values()))
    shape = (first.rows_per_tile, *first.pixel_shape)
    urls = [join(root, e.path) for e in manifest.rank_shards(0)]

    def collate(sample: dict) -> dict:
        meta = json.loads(sample["json"])
        ids = np.load(io.BytesIO(sample["input_ids.npy"]))
        labels = np.load(io.BytesIO(sample["labels.npy"]))
        n = len(ids)
        input_ids = torch.full((manifest.qt,), manifest.pad_token_id, dtype=torch.long)
        input_ids[:n] = torch.from_numpy(ids.astype(np.int64))
        lab = torch.full((manifest.qt,), IGNORE_INDEX, dtype=torch.long)
        lab[:n] = torch.from_numpy(labels.astype(np.int64))
        pixels = torch.zeros((manifest.qv * shape[0], *shape[1:]))
        images = iter(msgpack.unpackb(sample["images.mp"]))
        tile = 0
        for s in meta["samples"]:
            policy = policies[s["source"]]
            for _ in s["images"]:
                with Image.open(io.BytesIO(next(images))) as im:
                    tiles = torch.from_numpy(policy.pixels(to_rgb(im), len(s["images"])))
                pixels[tile:tile + len(tiles)] = tiles
                tile += len(tiles)
        segments = meta["seq_lens"] + ([manifest.qt - n] if n < manifest.qt else [])
        return {"input_ids": input_ids, "labels": lab, "pixel_values": pixels,
                "position_ids": torch.from_numpy(np.concatenate([np.arange(x) for x in segments])),
                "image_token_mask": input_ids == manifest.image_token_id}

    return wds.WebDataset(urls, shardshuffle=False, empty_check=False).map(collate)


def timed(loader, limit: int) -> float:
    """Micro-batches per second over ``limit`` batches after the first."""
    it = iter(loader)
    next(it)
    start, n = time.perf_counter(), 0
    for _ in it:
        n += 1
        if n == limit:
            break
    return n / (time.perf_counter() - start)


def bench_load(root: str, workers: int, limit: int, repeats: int) -> dict:
    ours, plain = [], []
    for _ in range(repeats):
        ours.append(timed(make_loader(root, num_workers=workers), limit))
        plain.append(timed(DataLoader(plain_webdataset(root), batch_size=None,
                                      num_workers=workers,
                                      prefetch_factor=4 if workers else None), limit))
    o, p = statistics.median(ours), statistics.median(plain)
    return {"workers": workers, "ours": o, "plain": p, "ratio": o / p, "overhead": 1 - o / p,
            "ours_runs": ours, "plain_runs": plain}


def _rchar() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


def bench_reads(root: str, workers: int, repeats: int) -> dict:
    """Per worker of ``workers``: MB read and seconds, seeking and streaming (medians)."""
    ds = ShardDataset(root)
    modes = {"seek": lambda w: ds.worker_records(w, workers),
             "stream": lambda w: (r for i, r in enumerate(ds.records()) if i % workers == w)}
    out = {"workers": workers}
    for mode, records in modes.items():
        mb, seconds = [], []
        for _ in range(repeats):
            for w in range(workers):
                before, start = _rchar(), time.perf_counter()
                n = sum(1 for _ in records(w))
                seconds.append(time.perf_counter() - start)
                mb.append((_rchar() - before) / 1e6)
        out[mode] = {"mb_per_worker": statistics.median(mb),
                     "s_per_worker": statistics.median(seconds), "records": n}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work", default=os.path.join(REPO, "build", "bench", "shards"))
    p.add_argument("--scale", type=int, default=3, help="demo dataset scale")
    p.add_argument("--shard-bytes", default="16MB")
    p.add_argument("--records", type=int, default=24, help="timed micro-batches per load run")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", help="also write the numbers here")
    p.add_argument("--only-reads", action="store_true",
                   help="only the reads-per-worker table (writes one folder, no load timing)")
    args = p.parse_args()
    torch.set_num_threads(1)  # as a DataLoader worker runs; keeps 0 workers comparable

    pre, plan = prepare(args.work, args.scale)
    writes = [bench_write(args.work, pre, plan, w, args.shard_bytes)
              for w in ((1,) if args.only_reads else (1, 2))]
    root = writes[0]["out"]
    manifest = read_manifest(root)
    loads = [] if args.only_reads else [bench_load(root, w, args.records, args.repeats)
                                        for w in (0, 1, 2)]
    reads = [bench_reads(root, w, args.repeats) for w in (1, 2, 4)]

    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"python {platform.python_version()}, torch {torch.__version__}")
    print(f"data: {manifest.records} micro-batches, {sum(e.samples for e in manifest.shards)} "
          f"samples, Qv={manifest.qv} Qt={manifest.qt}, {manifest.bytes / 1e6:.0f} MB in "
          f"{len(manifest.shards)} shards\n")
    print("| write workers | MB written | seconds | MB/s |\n|---|---|---|---|")
    for w in writes:
        print(f"| {w['workers']} | {w['bytes'] / 1e6:.0f} | {w['seconds']:.2f} | "
              f"{w['mb_per_s']:.0f} |")
    print("\n| loader workers | vlmshard mb/s | plain webdataset mb/s | ratio | overhead |\n"
          "|---|---|---|---|---|")
    for r in loads:
        print(f"| {r['workers']} | {r['ours']:.2f} | {r['plain']:.2f} | {r['ratio']:.3f} | "
              f"{100 * r['overhead']:.1f}% |")
    print("\n| loader workers | streamed: MB read per worker | s | sought: MB read per worker | "
          "s |\n|---|---|---|---|---|")
    for r in reads:
        print(f"| {r['workers']} | {r['stream']['mb_per_worker']:.0f} | "
              f"{r['stream']['s_per_worker']:.2f} | {r['seek']['mb_per_worker']:.0f} | "
              f"{r['seek']['s_per_worker']:.2f} |")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"write": writes, "load": loads, "reads": reads}, f, indent=1)


if __name__ == "__main__":
    main()
