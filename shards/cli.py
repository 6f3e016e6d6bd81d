"""``vlmshard write``: the command-line face of ``shards.writer.run_write``."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

from vlmshard.config import add_options, load_config

from .config import WriteConfig

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
    add_options(p, WriteConfig)
    p.add_argument("--json", action="store_true", help="print the result as JSON")


def main(args: argparse.Namespace) -> int:
    from .writer import WriteError, run_write

    as_json = args.__dict__.pop("json")
    try:
        result = run_write(load_config(WriteConfig, args))
    except (WriteError, OSError, ValueError) as e:  # StatsError is a ValueError; a full disk
        raise SystemExit(f"vlmshard write: error: {e}") from None
    if as_json:
        print(json.dumps(asdict(result), indent=1))
    else:
        print(f"{result.shards} shard(s), {result.records} record(s), "
              f"{result.bytes / 1e6:.1f} MB -> {result.out} "
              f"({'already complete' if result.already_complete else f'{result.seconds:.1f}s'})")
    return 0
