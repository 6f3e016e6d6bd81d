"""``vlmshard pack``: the command-line face of ``vlmshard.packing.plan.run_pack``."""

from __future__ import annotations

from vlmshard.stage import stage_command

from .config import PackConfig

DESCRIPTION = """\
Reads the stats table (the preprocess output folder) or OmniBal length files (a JSON list of
{vit_num, token_num} or OmniBal's meta JSON naming several token_lengths files) and writes
OUT/plan.parquet (step, rank, micro, slot, sample_id: Contract 2 of docs/design.md) and
OUT/plan.json (options, caps, cost model, metrics, unplaced samples with reasons) and
OUT/plan.run.json (this run's facts: the stats' path, host, timings).

Every step has DP x MICRO_BATCHES micro-batches (or VIRTUAL_RANKS x MICRO_BATCHES: shards planned
for V virtual ranks serve any real DP size that divides V). Each micro-batch holds at most Qv
ViT tiles and Qt LLM tokens. Algorithms:
  balanced     near-full on tiles and tokens, equal tiles, tokens, attention and cost on every
               rank at every step, data order kept random; Qv/Qt chosen from the data
  isf          OmniBal's Iterative Sampling and Filtering, with its Qv/Qt search when not given
  lengthgroup  LLaVA's length-grouped megabatches, TARGET_SAMPLES per micro-batch, padded
  random       TARGET_SAMPLES per micro-batch in random order, padded

The same input, options and seed give a byte-identical plan.parquet; epoch e uses SEED + e."""


add_arguments, main = stage_command("pack", PackConfig, "vlmshard.packing.plan:run_pack")
