"""``vlmshard verify``: the command-line face of ``vlmshard.shards.verify.run_verify``."""

from __future__ import annotations

from vlmshard.stage import stage_command

from .config import VerifyConfig

DESCRIPTION = """\
Proves a shard folder holds exactly its plan, byte for byte. Full check, per shard (in
parallel): sha256 and size, record count, records in (step, micro) order, every member decodable
(json, npy, each image decoded in full), CRC-32 of every member, tile counts recomputed from the
decoded image sizes, and image-token counts. Across shards: every rank covers the same steps
back to back, no unlisted tars. With --plan: every planned sample sits exactly once at its
planned (step, rank, micro, slot). Exits 1 with a FAIL line per problem."""


add_arguments, main = stage_command("verify", VerifyConfig, "vlmshard.shards.verify:run_verify")
