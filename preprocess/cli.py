"""``vlmshard preprocess``: the command-line face of ``preprocess.job.run_preprocess``."""

from __future__ import annotations

import argparse
import json
import logging
from dataclasses import asdict

from vlmshard.config import load_config
from vlmshard.engines import add_engine_arguments

from .job import ConfigError, PreprocessConfig, RejectRatioExceeded, run_preprocess
from .tiling import POLICIES

log = logging.getLogger(__name__)

HELP = "tokenize conversations and count image tiles into the stats table (Contract 1)"
DESCRIPTION = """\
Reads conversation data and writes OUT/stats/part-*.parquet (one row per accepted sample:
tiles, tokens, sequence length), OUT/rejects.parquet (every rejected row with a reason) and
OUT/preprocess.json (config and per-source reconciliation: input rows = accepted + rejected).

An INPUT is a LLaVA/InternVL conversation file (.json list or .jsonl), an InternVL meta file
({name: {root, annotation, repeat_time}}), a .parquet file, or a folder saved with
datasets.save_to_disk. Images are read by header only (no pixel decode), from local paths or
fsspec URLs. The job commits its work in parts: rerun the same command after a crash and it
resumes; rerun a finished job and it does nothing."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    S = argparse.SUPPRESS  # only flags the user passes override the --config file
    p.add_argument("inputs", nargs="*", default=S, metavar="INPUT", help="input files or folders")
    p.add_argument("--config", help="YAML file with any of these options (flags override it)")
    p.add_argument("--out", default=S, help="output folder (required)")
    p.add_argument("--image-root", dest="image_root", default=S,
                   help="folder or URL that relative image paths start from "
                        "(default: the annotation file's folder; meta files give 'root')")
    p.add_argument("--tokenizer", default=S,
                   help="'tekken' (default: the Tekken file inside mistral-common) or a path to "
                        "a tokenizer.json")
    p.add_argument("--template", default=S,
                   help="chat template: mistral (default for tekken) or chatml (default for "
                        "tokenizer.json)")
    p.add_argument("--tiling", default=S, choices=sorted(POLICIES),
                   help="tile counting policy (default: internvl, 448 px tiles, 256 tokens each)")
    p.add_argument("--max-num", dest="max_num", type=int, default=S,
                   help="internvl: most tiles per sample, split across its images (default 12)")
    p.add_argument("--min-num", dest="min_num", type=int, default=S,
                   help="internvl: fewest tiles per image (default 1)")
    add_engine_arguments(p, "workers")
    p.add_argument("--keep-tokens", dest="keep_tokens", action="store_true", default=S,
                   help="store input_ids and labels in the stats table")
    p.add_argument("--max-seq-len", dest="max_seq_len", type=int, default=S,
                   help="reject samples longer than this (default: no limit)")
    p.add_argument("--max-image-pixels", dest="max_image_pixels", type=int, default=S,
                   help="reject images with more pixels, as decompression bombs "
                        "(default 89478485, Pillow's limit)")
    p.add_argument("--max-reject-ratio", dest="max_reject_ratio", type=float, default=S,
                   help="fail (exit 3) if more than this fraction of rows is rejected")
    p.add_argument("--part-size", dest="part_size", type=int, default=S,
                   help="rows per committed part, the unit of resume (default 2048)")
    p.add_argument("--seed", type=int, default=S, help="seed for repeat_time < 1 subsampling")
    p.add_argument("--json", action="store_true", help="print the result as JSON")


def main(args: argparse.Namespace) -> int:
    flags = {k: v for k, v in vars(args).items() if k not in ("config", "json", "func")}
    try:
        cfg = load_config(PreprocessConfig, flags, args.config)
        result = run_preprocess(cfg)
    except (ConfigError, ValueError) as e:
        raise SystemExit(f"vlmshard preprocess: error: {e}") from None
    except RejectRatioExceeded as e:
        log.error("%s", e)
        return 3
    if args.json:
        print(json.dumps(asdict(result), indent=1))
    else:
        print(f"{result.accepted} samples accepted, {result.rejected} rejected "
              f"of {result.input_rows} rows -> {result.out}/stats "
              f"({'already complete' if result.already_complete else f'{result.seconds:.1f}s'})")
    return 0
