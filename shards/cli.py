"""``vlmshard write``: the command-line face of ``vlmshard.shards.writer.run_write``."""

from __future__ import annotations

from vlmshard.stage import stage_command

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


add_arguments, main = stage_command("write", WriteConfig, "vlmshard.shards.writer:run_write")
