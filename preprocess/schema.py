"""Arrow schemas of Contract 1 (``docs/design.md``): the stats table and the rejects table."""

from __future__ import annotations

import pyarrow as pa

IMAGE_SIZE = pa.struct([("w", pa.int32()), ("h", pa.int32())])
# A video: its files (one container, or its frame images), the frames the family's rule keeps
# (indices, the last repeated to whole temporal patches), the probe's counts, the model's grid,
# ViT units and LLM tokens, and its place among the sample's image and video items.
VIDEO = pa.struct([
    ("paths", pa.list_(pa.string())),
    ("frame_list", pa.bool_()),
    ("frames", pa.list_(pa.int32())),
    ("total_frames", pa.int32()),
    ("fps", pa.float64()),
    ("w", pa.int32()),
    ("h", pa.int32()),
    ("grid", pa.list_(pa.int32())),
    ("tiles", pa.int32()),
    ("tokens", pa.int32()),
    ("seconds_per_step", pa.float64()),
    ("bytes", pa.list_(pa.int64())),
    ("item", pa.int16()),
])
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
    pa.field("videos", pa.list_(VIDEO), nullable=False),
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
