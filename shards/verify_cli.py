"""``vlmshard verify``: the command-line face of ``shards.verify.verify_shards``."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

from vlmshard.config import ConfigError, add_options, load_config

from .config import VerifyConfig

DESCRIPTION = """\
Proves a shard folder holds exactly its plan, byte for byte. Full check, per shard (in
parallel): sha256 and size, record count, records in (step, micro) order, every member decodable
(json, npy, each image decoded in full), CRC-32 of every member, tile counts recomputed from the
decoded image sizes, and image-token counts. Across shards: every rank covers the same steps
back to back, no unlisted tars. With --plan: every planned sample sits exactly once at its
planned (step, rank, micro, slot). Exits 1 with a FAIL line per problem."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_options(p, VerifyConfig)
    p.add_argument("--json", action="store_true", help="print the result as JSON")


def main(args: argparse.Namespace) -> int:
    from .verify import MAX_SHOWN, verify_shards

    as_json = args.__dict__.pop("json")
    try:
        cfg = load_config(VerifyConfig, args)
    except ConfigError as e:
        raise SystemExit(f"vlmshard verify: error: {e}") from None
    result = verify_shards(cfg.shards, plan=cfg.plan, quick=cfg.quick, workers=cfg.workers)
    if as_json:
        print(json.dumps(asdict(result), indent=1))
    elif result.ok:
        print(f"OK{' (quick)' if result.quick else ''}: {result.shards} shard(s), "
              f"{result.records} record(s), {result.samples} sample(s), {result.ranks} rank(s) "
              f"x {result.steps} step(s), {result.bytes / 1e6:.1f} MB ({result.seconds:.1f}s)")
    else:
        for problem in result.problems[:MAX_SHOWN]:
            print(f"FAIL {problem}")
        more = len(result.problems) - MAX_SHOWN
        print(f"{result.root}: {len(result.problems)} problem(s)"
              + (f" ({more} more with --json)" if more > 0 else ""))
    return 0 if result.ok else 1
