"""``vlmshard preprocess``: the command-line face of ``preprocess.job.run_preprocess``."""

from __future__ import annotations

import argparse
import json
import logging
from dataclasses import asdict

from vlmshard.config import add_options, load_config

from .config import PreprocessConfig

log = logging.getLogger(__name__)

DESCRIPTION = """\
Reads conversation data and writes OUT/stats/part-*.parquet (one row per accepted sample:
tiles, tokens, sequence length), OUT/rejects.parquet (every rejected row with a reason) and
OUT/preprocess.json (config and per-source reconciliation: input rows = accepted + rejected).

An INPUT is a LLaVA/InternVL conversation file (.json list or .jsonl), an InternVL meta file
({name: {root, annotation, repeat_time}}), a .parquet file, or a folder saved with
datasets.save_to_disk. Images are read by header only (no pixel decode), from local paths or
fsspec URLs. The job commits its work in parts: rerun the same command after a crash and it
resumes; rerun a finished job and it does nothing.

--model PATH (a local Hugging Face folder of an InternVL, Qwen2-VL or Qwen2.5-VL checkpoint)
makes the samples that model's: its chat template and tokenizer (rendered by transformers; text
in the data never becomes control tokens), its image tokens, and its image processor's tiling
limits. Without it, the offline demo tokenizer (Tekken, mistral template) is used."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_options(p, PreprocessConfig)
    p.add_argument("--json", action="store_true", help="print the result as JSON")


def main(args: argparse.Namespace) -> int:
    from .job import RejectRatioExceeded, run_preprocess

    as_json = args.__dict__.pop("json")
    try:
        result = run_preprocess(load_config(PreprocessConfig, args))
    except (ValueError, OSError) as e:  # ConfigError, unreadable sources, a full disk, ...
        raise SystemExit(f"vlmshard preprocess: error: {e}") from None
    except RejectRatioExceeded as e:
        log.error("%s", e)
        return 3
    if as_json:
        print(json.dumps(asdict(result), indent=1))
    else:
        print(f"{result.accepted} samples accepted, {result.rejected} rejected "
              f"of {result.input_rows} rows -> {result.out}/stats "
              f"({'already complete' if result.already_complete else f'{result.seconds:.1f}s'})")
    return 0
