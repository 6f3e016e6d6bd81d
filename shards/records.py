"""One record = one packed micro-batch: its members, how they are encoded, and how they are checked.

Every record has the same four members (tar order is sorted by member name, as
``webdataset.TarWriter`` writes), so generic WebDataset readers (HF ``datasets``, Energon) take the
shards as they are:

- ``KEY.images.mp``: a msgpack list of each image's original encoded bytes, in token order (an
  empty list for a micro-batch without images);
- ``KEY.input_ids.npy``, ``KEY.labels.npy``: the packed samples' ids back to back (int32, no
  padding; labels are -100 outside assistant turns);
- ``KEY.json``: step, rank, micro, the samples (id, source, row, seq_len, loss_tokens, tiles per
  image, image names), ``seq_lens``, ``cu_seqlens`` and a CRC-32 of every other member, so a
  flipped byte is caught at the record that holds it, not only by the shard's sha256.
"""

from __future__ import annotations

import io
import json
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator

import numpy as np

from vlmshard.errors import InputError
from vlmshard.rejects import Reject

from .layout import parse_key, record_key

if TYPE_CHECKING:
    from PIL import Image

    from vlmshard.families import TilingPolicy

JSON = "json"
INPUT_IDS = "input_ids.npy"
LABELS = "labels.npy"
IMAGES = "images.mp"
MEMBERS = (IMAGES, INPUT_IDS, JSON, LABELS)


class RecordError(InputError):
    """A record that does not decode or does not agree with itself; names shard and record."""


@dataclass
class Record:
    shard: str  # where it was read from, for error messages
    key: str
    step: int
    rank: int
    micro: int
    samples: list[dict]  # as in the json member
    input_ids: np.ndarray  # int32 [Σ seq_len]
    labels: np.ndarray
    images: list[bytes]  # in token order (sample by sample)
    cu_seqlens: list[int]

    @property
    def seq_lens(self) -> list[int]:
        return [s["seq_len"] for s in self.samples]

    @property
    def where(self) -> str:
        return f"{self.shard}: record {self.key}"


def image_name(index: int, path: str, fmt: str) -> str:
    """Name of a record's ``index``-th image: the file's own extension, else its format."""
    base = path.rsplit("/", 1)[-1]
    ext = base.rsplit(".", 1)[-1].lower() if "." in base else fmt.lower() or "img"
    return f"{index:03d}.{ext}"


def _npy(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.lib.format.write_array(buf, np.ascontiguousarray(array, dtype=np.int32),
                              allow_pickle=False)
    return buf.getvalue()


def encode_record(step: int, rank: int, micro: int, samples: list[dict],
                  input_ids: np.ndarray, labels: np.ndarray,
                  images: list[bytes]) -> dict:
    """A webdataset sample dict (``__key__`` plus member bytes) for ``webdataset.TarWriter``.

    ``samples`` hold sample_id, source, row, seq_len, loss_tokens, image_tiles and the names of
    their images; ``images`` are the images' encoded bytes in the samples' order."""
    import msgpack

    members = {INPUT_IDS: _npy(input_ids), LABELS: _npy(labels),
               IMAGES: msgpack.packb(images, use_bin_type=True)}
    seq_lens = [s["seq_len"] for s in samples]
    meta = {
        "step": step, "rank": rank, "micro": micro,
        "samples": samples,
        "seq_lens": seq_lens,
        "cu_seqlens": np.concatenate([[0], np.cumsum(seq_lens)]).tolist(),
        "image_tiles": [t for s in samples for t in s["image_tiles"]],
        "crc32": {name: zlib.crc32(data) for name, data in sorted(members.items())},
    }
    text = json.dumps(meta, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return {"__key__": record_key(step, micro), JSON: text.encode("utf-8"), **members}


def decode_record(sample: dict, where: str) -> Record:
    """Check and decode a grouped webdataset sample; raises ``RecordError`` naming ``where``."""
    key = sample.get("__key__", "?")
    shard, where = where, f"{where}: record {key}"
    if parse_key(key) is None:
        raise RecordError(f"{where}: not a vlmshard record key (expected STEP_MICRO)")
    if JSON not in sample:
        raise RecordError(f"{where}: no json member (the record is cut short or not ours)")
    try:
        meta = json.loads(sample[JSON])
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RecordError(f"{where}: json member does not parse: {e}") from None
    crc = meta.get("crc32", {})
    members = {k for k in sample if not k.startswith("__")}
    if members != set(MEMBERS) or set(crc) != members - {JSON}:
        raise RecordError(f"{where}: members {sorted(members)}, expected {sorted(MEMBERS)}")
    for name in sorted(crc):
        if zlib.crc32(sample[name]) != crc[name]:
            raise RecordError(f"{where}: member {name} is corrupt (CRC-32 mismatch)")
    import msgpack

    try:
        input_ids = np.load(io.BytesIO(sample[INPUT_IDS]), allow_pickle=False)
        labels = np.load(io.BytesIO(sample[LABELS]), allow_pickle=False)
        images = msgpack.unpackb(sample[IMAGES])
        samples = meta["samples"]
        record = Record(shard=shard, key=key, step=meta["step"], rank=meta["rank"],
                        micro=meta["micro"], samples=samples, input_ids=input_ids, labels=labels,
                        images=images, cu_seqlens=meta["cu_seqlens"])
        if len(images) != sum(len(s["images"]) for s in samples):
            raise ValueError(f"{len(images)} images for the samples' "
                             f"{sum(len(s['images']) for s in samples)}")
    except (KeyError, TypeError, ValueError, msgpack.UnpackException) as e:
        raise RecordError(f"{where}: malformed record: {e!r}") from None
    if parse_key(key) != (record.step, record.micro):
        raise RecordError(f"{where}: json says step {record.step} micro {record.micro}")
    total = sum(record.seq_lens)
    if input_ids.shape != (total,) or labels.shape != (total,):
        raise RecordError(f"{where}: input_ids {input_ids.shape} / labels {labels.shape} do not "
                          f"hold the {total} tokens of its samples")
    return record


def check_image_tokens(record: Record, image_token_id: int,
                       policies: dict[str, "TilingPolicy"]) -> None:
    """Each sample's image-token count must equal its tiles × the source policy's tokens per tile:
    that is what places every tile's embedding on its own token."""
    start = 0
    for sample in record.samples:
        span = record.input_ids[start:start + sample["seq_len"]]
        start += sample["seq_len"]
        have = int(np.count_nonzero(span == image_token_id))
        want = sum(sample["image_tiles"]) * policies[sample["source"]].tokens_per_tile
        if have != want:
            raise RecordError(f"{record.where}: sample {sample['sample_id']} has {have} image "
                              f"tokens, its tiles need {want}")


@dataclass
class DecodedImage:
    policy: "TilingPolicy"  # its source's tiling policy
    n_images: int  # images of its sample (InternVL's per-sample budget divides by it)
    width: int
    height: int
    rgb: "Image.Image | None"  # converted as transformers converts, when asked for

    def pixels(self) -> np.ndarray:
        """The model's float32 pixel rows for this image (see ``TilingPolicy.pixels``)."""
        return self.policy.pixels(self.rgb, self.n_images)


def decoded_images(record: Record, policies: dict[str, "TilingPolicy"], *,
                   rgb: bool = True) -> Iterator[DecodedImage]:
    """Decode each image of ``record`` in full, in token order, and check that it makes the tiles
    the plan has under its source's policy; RGB pixels only with ``rgb``. The one decode of the
    loader and ``verify``."""
    from PIL import Image

    from vlmshard.families import to_rgb

    images = iter(record.images)
    for sample in record.samples:
        policy = policies[sample["source"]]
        n_images = len(sample["images"])
        for name, planned in zip(sample["images"], sample["image_tiles"]):
            try:
                with Image.open(io.BytesIO(next(images))) as im:
                    im.load()
                    width, height = im.size
                    converted = to_rgb(im) if rgb else None
            except Exception as e:
                raise RecordError(f"{record.where}: image {name} does not decode: {e}") from None
            try:
                tiles = policy.tiles(width, height, n_images)
            except Reject as e:
                raise RecordError(f"{record.where}: image {name}: {e.message}") from None
            if tiles != planned:
                raise RecordError(f"{record.where}: image {name} ({width}x{height}) of sample "
                                  f"{sample['sample_id']} makes {tiles} tiles, the plan has "
                                  f"{planned}")
            yield DecodedImage(policy, n_images, width, height, converted)
