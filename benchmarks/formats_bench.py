"""Embedded images against image files: the same rows, side by side in one run.

Two sources hold the same conversations (``messages`` with ``<image>`` placeholders, 1-3 of the
demo's JPEGs each, 17-290 kB, ~200 tokens of text):

- ``files``: JSONL, each image a path to its file;
- ``embedded``: Parquet as the Hub holds image datasets, each image's bytes embedded in a
  ``datasets`` ``Sequence(Image())`` column, 100 rows per row group (``datasets``' writer
  batch for image features).

Each is preprocessed (``--workers`` local processes, Tekken), packed once, and written to
shards; the runs alternate files/embedded ``--repeats`` times and the medians are compared.
The shards of the two hold the same image bytes (checked).

    python benchmarks/formats_bench.py --samples 2000 --out build/bench/formats

Prints a Markdown table for BENCHMARKS.md and writes results.json next to the data.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shutil
import statistics
import sys
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq


def make_sources(root: str, n: int, seed: int = 0) -> dict[str, str]:
    import datasets

    from vlmshard.demo.data import WORDS, generate

    demo = generate(os.path.abspath(os.path.join(root, "demo")), seed=seed)
    images = [i for i in demo.images
              if i.endswith(".jpg") and not i.startswith(("images/tiny", "images/huge"))]
    rng = np.random.default_rng(seed)
    words = np.array(WORDS)
    rows = []
    for _ in range(n):
        k = int(rng.integers(1, 4))
        question = " ".join(words[rng.integers(0, len(words), 40)])
        answer = " ".join(words[rng.integers(0, len(words), 160)])
        rows.append({"images": [os.path.join(demo.root, images[j])
                                for j in rng.integers(0, len(images), k)],
                     "messages": [{"role": "user", "content": "<image>" * k + question},
                                  {"role": "assistant", "content": answer}]})
    files = os.path.join(root, "files.jsonl")
    with open(files, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    cache: dict[str, bytes] = {}

    def embedded(path: str) -> dict:
        if path not in cache:
            with open(path, "rb") as f:
                cache[path] = f.read()
        return {"bytes": cache[path], "path": os.path.basename(path)}

    features = datasets.Features({
        "images": datasets.Sequence(datasets.Image()),
        "messages": [{"role": datasets.Value("string"), "content": datasets.Value("string")}]})
    parquet = os.path.join(root, "embedded.parquet")
    # Written a row group at a time: the images of all rows exceed one Arrow array's 2 GiB. No
    # dictionary encoding: the bench reuses 12 images, which a real dataset does not, and a
    # dictionary would store each once.
    with pq.ParquetWriter(parquet, features.arrow_schema, use_dictionary=False) as writer:
        for start in range(0, n, 100):
            batch = [{**r, "images": [embedded(p) for p in r["images"]]}
                     for r in rows[start:start + 100]]
            writer.write_table(pa.Table.from_pylist(batch, schema=features.arrow_schema))
    return {"files": files, "embedded": parquet}


def run_once(source: str, out: str, workers: int) -> tuple[float, float, int]:
    """(preprocess seconds, write seconds, shard bytes)."""
    from vlmshard.packing.config import PackConfig
    from vlmshard.packing.plan import run_pack
    from vlmshard.preprocess import PreprocessConfig, run_preprocess
    from vlmshard.shards.config import WriteConfig
    from vlmshard.shards.writer import run_write

    shutil.rmtree(out, ignore_errors=True)
    pre, plan, shards = (os.path.join(out, n) for n in ("pre", "plan", "shards"))
    start = time.perf_counter()
    run_preprocess(PreprocessConfig(inputs=[source], out=pre, workers=workers))
    preprocess = time.perf_counter() - start
    run_pack(PackConfig(stats=pre, dp=2, out=plan))
    start = time.perf_counter()
    written = run_write(WriteConfig(plan=plan, stats=pre, out=shards, workers=workers))
    return preprocess, time.perf_counter() - start, written.bytes


def shard_images(out: str) -> list[bytes]:
    """Every image in the shards, in shard and record order."""
    import glob
    import tarfile

    import msgpack

    found = []
    for path in sorted(glob.glob(os.path.join(out, "shards", "rank-*", "*.tar"))):
        with tarfile.open(path) as tar:
            for member in tar.getmembers():
                if member.name.endswith(".images.mp"):
                    found += msgpack.unpackb(tar.extractfile(member).read())
    return found


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=2000)
    p.add_argument("--out", default="build/bench/formats")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3, help="alternating runs of each source")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    os.makedirs(args.out, exist_ok=True)
    sources = make_sources(args.out, args.samples)
    times: dict[str, list[tuple[float, float, int]]] = {name: [] for name in sources}
    for _ in range(args.repeats):
        for name, path in sources.items():
            times[name].append(run_once(path, os.path.join(args.out, name), args.workers))
            print(name, times[name][-1], file=sys.stderr, flush=True)
    same = shard_images(os.path.join(args.out, "files")) == shard_images(
        os.path.join(args.out, "embedded"))
    results = {"samples": args.samples, "workers": args.workers, "repeats": args.repeats,
               "machine": platform.platform(), "cpus": os.cpu_count(),
               "source_bytes": {n: os.path.getsize(p) for n, p in sources.items()},
               "same_image_bytes_in_shards": same, "runs": times}
    print("| source | preprocess rows/s (median) | write MB/s (median) | shard MB |\n"
          "|---|---:|---:|---:|")
    medians = {}
    for name, runs in times.items():
        pre = statistics.median(r[0] for r in runs)
        write = statistics.median(r[1] for r in runs)
        medians[name] = (args.samples / pre, runs[0][2] / 1e6 / write)
        print(f"| {name} | {medians[name][0]:,.0f} | {medians[name][1]:,.1f} | "
              f"{runs[0][2] / 1e6:,.1f} |")
    ratio = [medians["embedded"][i] / medians["files"][i] for i in range(2)]
    results["ratio_embedded_over_files"] = {"preprocess": ratio[0], "write": ratio[1]}
    print(f"\nembedded / files: preprocess {ratio[0]:.2f}x, write {ratio[1]:.2f}x; "
          f"same image bytes in the shards: {same}")
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    if not same:
        sys.exit("the two sources' shards hold different image bytes")


if __name__ == "__main__":
    main()
