"""Arrow schemas of Contract 1 (``docs/design.md``): the stats table and the rejects table."""

from __future__ import annotations

import pyarrow as pa

IMAGE_SIZE = pa.struct([("w", pa.int32()), ("h", pa.int32())])
MAX_IMAGES_PER_SAMPLE = 2**15 - 1  # n_images is an int16: a row with more is a reject

STATS_FIELDS = [
    pa.field("sample_id", pa.int64(), nullable=False),
    pa.field("source", pa.string(), nullable=False),
    pa.field("row", pa.int64(), nullable=False),
    pa.field("n_images", pa.int16(), nullable=False),
    pa.field("image_tiles", pa.list_(pa.int16()), nullable=False),
    pa.field("vit_tiles", pa.int32(), nullable=False),
    pa.field("text_tokens", pa.int32(), nullable=False),
    pa.field("seq_len", pa.int32(), nullable=False),
    pa.field("loss_tokens", pa.int32(), nullable=False),
    pa.field("image_paths", pa.list_(pa.string()), nullable=False),
    pa.field("image_sizes", pa.list_(IMAGE_SIZE), nullable=False),
    pa.field("image_bytes", pa.list_(pa.int64()), nullable=False),
]
TOKEN_FIELDS = [
    pa.field("input_ids", pa.list_(pa.int32()), nullable=False),
    pa.field("labels", pa.list_(pa.int32()), nullable=False),
]
REJECTS_SCHEMA = pa.schema([
    pa.field("source", pa.string(), nullable=False),
    pa.field("row", pa.int64(), nullable=False),
    pa.field("reason", pa.string(), nullable=False),
    pa.field("message", pa.string(), nullable=False),
])


def stats_schema(keep_tokens: bool, with_sample_id: bool = True) -> pa.Schema:
    fields = STATS_FIELDS if with_sample_id else STATS_FIELDS[1:]
    return pa.schema(fields + (TOKEN_FIELDS if keep_tokens else []))
