"""``vlmshard write``: the command-line face of ``shards.writer.run_write``."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

from vlmshard.packing.stats import StatsError
from vlmshard.config import load_config
from vlmshard.engines import add_engine_arguments

from .writer import WriteConfig, WriteError, run_write

HELP = "write a plan's micro-batches as pre-balanced WebDataset shards (Contract 3)"
DESCRIPTION = """\
Writes OUT/rank-XXXXX/shard-XXXXXX.tar, one folder per (virtual) rank of the plan, records in
step order, one record per packed micro-batch (key STEP_MICRO: json with the samples, seq lens,
tiles and cu_seqlens; input_ids.npy; labels.npy; each image's original bytes), then
OUT/manifest.json with every shard's record count, step range, bytes and sha256.

Token ids come from the stats table when preprocess kept them (--keep-tokens), otherwise they
are re-tokenized from the sources with the recorded tokenizer and checked against the plan.
Images are read through fsspec; one that vanished or changed since preprocessing stops the
write with the sample named. Each shard is written atomically: rerun the same command after a
crash and it finishes the rest with byte-identical output; rerun a finished write and it does
nothing. Check the result with `vlmshard verify OUT --plan PLAN`."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    S = argparse.SUPPRESS  # only flags the user passes override the --config file
    p.add_argument("--config", help="YAML file with any of these options (flags override it)")
    p.add_argument("--plan", default=S, help="plan folder written by vlmshard pack (required)")
    p.add_argument("--stats", default=S, help="the preprocess output folder the plan was "
                                              "packed from (required)")
    p.add_argument("--out", default=S, help="shard folder to write (required)")
    add_engine_arguments(p, "shard writers")
    p.add_argument("--shard-bytes", dest="shard_bytes", default=S,
                   help="target shard size, e.g. 1GB (default) or 256MiB; shards hold whole "
                        "steps, so one step larger than this makes a larger shard")
    p.add_argument("--json", action="store_true", help="print the result as JSON")


def main(args: argparse.Namespace) -> int:
    flags = {k: v for k, v in vars(args).items() if k not in ("config", "json")}
    try:
        result = run_write(load_config(WriteConfig, flags, args.config))
    except (WriteError, StatsError, FileNotFoundError, ValueError) as e:
        raise SystemExit(f"vlmshard write: error: {e}") from None
    if args.json:
        print(json.dumps(asdict(result), indent=1))
    else:
        print(f"{result.shards} shard(s), {result.records} record(s), "
              f"{result.bytes / 1e6:.1f} MB -> {result.out} "
              f"({'already complete' if result.already_complete else f'{result.seconds:.1f}s'})")
    return 0
