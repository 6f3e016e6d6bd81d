"""``vlmshard preprocess``: the command line of ``vlmshard.preprocess.job.run_preprocess``."""

from __future__ import annotations

from vlmshard.stage import stage_command

from .config import PreprocessConfig

DESCRIPTION = """\
Reads conversation data and writes OUT/stats/part-*.parquet (one row per accepted sample:
tiles, tokens, sequence length), OUT/rejects.parquet (every rejected row with a reason) and
OUT/preprocess.json (config and per-source reconciliation: input rows = accepted + rejected).

An INPUT is a LLaVA/InternVL conversation file (.json list or .jsonl), an InternVL meta file
({name: {root, annotation, repeat_time}}), a .parquet file, or a folder saved with
datasets.save_to_disk. Images are read by header only (no pixel decode), from local paths or
fsspec URLs. The job commits its work in parts: rerun the same command after a crash and it
resumes; rerun a finished job and it does nothing.

--model PATH (a local Hugging Face folder whose config.json model_type a registered family
serves; see --model below) makes the samples that model's: its chat template and tokenizer
(rendered by transformers; text in the data never becomes control tokens), its image tokens,
and its image processor's tiling limits. Without it, the offline demo tokenizer (Tekken,
mistral template) is used."""


add_arguments, main = stage_command("preprocess", PreprocessConfig,
                                    "vlmshard.preprocess.job:run_preprocess")
