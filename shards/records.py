"""One record = one packed micro-batch: its members, how they are encoded, and how they are checked.

Every record has the same four members (tar order is sorted by member name, as
``webdataset.TarWriter`` writes), so generic WebDataset readers (HF ``datasets``, Energon) take the
shards as they are:

- ``KEY.images.mp``: a msgpack list of each image's original encoded bytes and each video's
  sampled frames (lossless PNGs decoded once at write time; a frame list's own files), in token
  order (an empty list for a micro-batch without images);
- ``KEY.input_ids.npy``, ``KEY.labels.npy``: the packed samples' ids back to back (int32, no
  padding; labels are -100 outside assistant turns);
- ``KEY.json``: step, rank, micro, the samples (id, source, row, seq_len, loss_tokens, tiles per
  image, image names; per video its frame names, frame indices, grid, tiles, tokens, frame rate
  and place among the sample's items), ``seq_lens``, ``cu_seqlens`` and a CRC-32 of every
  other member, so a
  flipped byte is caught at the record that holds it, not only by the shard's sha256.
"""

from __future__ import annotations

import hashlib
import io
import json
import zlib
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, ClassVar, Iterator

import numpy as np

from vlmshard.errors import InputError
from vlmshard.packing.batches import in_token_order
from vlmshard.rejects import Reject

from .layout import parse_key, record_key

if TYPE_CHECKING:
    from PIL import Image

    from vlmshard.families import TilingPolicy
    from vlmshard.families.base import SampledVideo

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
    def tiles(self) -> int:
        """The ViT units of its images and videos."""
        return tiles_of(self.samples)

    def media_units(self) -> list[tuple[int, int]]:
        """Each image's and video's planned tiles and ViT units, in token order: an image is
        one unit, a video one per temporal step (its grid's t)."""
        return [medium for sample in self.samples for medium in in_token_order(
            sample["image_tiles"], {v["item"]: (v["tiles"], v["grid"][0])
                                    for v in sample.get("videos", ())})]

    @property
    def where(self) -> str:
        return f"{self.shard}: record {self.key}"


def tiles_of(samples: list[dict]) -> int:
    """The ViT units of the images and videos of a record's ``samples`` (its json member's)."""
    return sum(sum(s["image_tiles"]) + sum(v["tiles"] for v in s.get("videos", ()))
               for s in samples)


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
        raise RecordError(f"{where}: json member does not parse: {e}") from e
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
        want = sum(len(s["images"]) + sum(len(v["frames"]) for v in s.get("videos", ()))
                   for s in samples)
        if len(images) != want:
            raise ValueError(f"{len(images)} images and frames for the samples' {want}")
    except (KeyError, TypeError, ValueError, msgpack.UnpackException) as e:
        raise RecordError(f"{where}: malformed record: {e!r}") from e
    if parse_key(key) != (record.step, record.micro):
        raise RecordError(f"{where}: json says step {record.step} micro {record.micro}")
    total = sum(record.seq_lens)
    if input_ids.shape != (total,) or labels.shape != (total,):
        raise RecordError(f"{where}: input_ids {input_ids.shape} / labels {labels.shape} do not "
                          f"hold the {total} tokens of its samples")
    return record


def check_image_tokens(record: Record, visual_ids: tuple[int, ...],
                       policies: dict[str, "TilingPolicy"]) -> None:
    """Each sample's image- and video-token count must equal its image tiles × the source
    policy's tokens per tile plus its videos' tokens: that is what places every tile's and
    frame's embedding on its own token."""
    start = 0
    for sample in record.samples:
        span = record.input_ids[start:start + sample["seq_len"]]
        start += sample["seq_len"]
        have = int(np.count_nonzero(np.isin(span, visual_ids)))
        want = (sum(sample["image_tiles"]) * policies[sample["source"]].tokens_per_tile
                + sum(v["tokens"] for v in sample.get("videos", ())))
        if have != want:
            raise RecordError(f"{record.where}: sample {sample['sample_id']} has {have} image "
                              f"and video tokens, its tiles and frames need {want}")


@dataclass
class DecodedImage:
    policy: "TilingPolicy"  # its source's tiling policy
    n_images: int  # images of its sample (InternVL's per-sample budget divides by it)
    width: int
    height: int
    rgb: "Image.Image | None"  # converted as transformers converts, when asked for

    is_video: ClassVar[bool] = False

    def pixels(self) -> np.ndarray:
        """The model's float32 pixel rows for this image (see ``TilingPolicy.pixels``)."""
        return self.policy.pixels(self.rgb, self.n_images)

    @property
    def grid(self) -> tuple[int, int, int] | None:
        return self.policy.grid_thw(self.width, self.height)

    @property
    def tiles(self) -> int:
        return self.policy.tiles(self.width, self.height, self.n_images)

    own_tiles = tiles


@dataclass
class DecodedVideo:
    policy: "TilingPolicy"
    video: "SampledVideo"  # as the source's policy samples it again
    frames: list  # RGB PIL images in order (empty without rgb): the segment's
    # the temporal steps [first, first + count) whose frames it decoded (a sequence-parallel
    # rank's piece, ``shards.sequence.media_pieces``); None: all of them
    segment: tuple[int, int] | None = None
    is_video: ClassVar[bool] = True

    def pixels(self) -> np.ndarray:
        """The model's float32 pixel rows for the decoded steps' frames: the whole video's
        rows of those steps (its grid and frame size are the whole's)."""
        video = self.video
        if self.segment is not None:
            video = replace(video, grid=(self.segment[1], *video.grid[1:]),
                            tiles=self.own_tiles)
        return self.policy.video_pixels(self.frames, video)

    @property
    def own_tiles(self) -> int:
        """The tiles of the decoded steps."""
        if self.segment is None:
            return self.video.tiles
        return self.video.tiles // self.video.grid[0] * self.segment[1]

    @property
    def grid(self) -> tuple[int, int, int] | None:
        return self.video.grid if self.policy.takes_grid else None

    @property
    def tiles(self) -> int:
        return self.video.tiles


def decoded_images(record: Record, policies: dict[str, "TilingPolicy"], *,
                   rgb: bool = True, own: dict[int, tuple[int, int]] | None = None,
                   known: set[bytes] | None = None) -> Iterator["DecodedImage | DecodedVideo"]:
    """Decode each image and video frame of ``record`` in full, in token order, and check that
    each image makes the tiles the plan has under its source's policy and each video the frames
    and grid; RGB pixels only with ``rgb``. The one decode of the loader and ``verify``. With
    ``own`` (media indices in token order, each with the units it decodes: a video's temporal
    steps (first, count)), the rest are read to their headers only: their sizes checked, no
    pixels (a sequence-parallel share's loader). ``known`` (without ``rgb``:
    ``verify``'s): digests of image bytes decoded in full before, which decode alike and are read
    to their headers; each image decoded here joins it (an image many samples share, or an
    epoch's repeat, is decoded once)."""
    data = iter(record.images)
    index = -1
    for sample in record.samples:
        policy = policies[sample["source"]]
        n_images = len(sample["images"])
        images = iter(zip(sample["images"], sample["image_tiles"]))
        videos = {v["item"]: v for v in sample.get("videos", ())}
        for item in range(n_images + len(videos)):
            index += 1
            full = own is None or index in own
            if item in videos:
                yield _decoded_video(record, sample, videos[item], policy, data, rgb,
                                     None if own is None else own.get(index, (0, 0)))
                continue
            name, planned = next(images)
            image = next(data)
            load = full and not _seen(image, known)
            width, height, converted = _decode(record, name, image, rgb and full, load)
            try:
                tiles = policy.tiles(width, height, n_images)
            except Reject as e:
                raise RecordError(f"{record.where}: image {name}: {e.message}") from e
            if tiles != planned:
                raise RecordError(f"{record.where}: image {name} ({width}x{height}) of sample "
                                  f"{sample['sample_id']} makes {tiles} tiles, the plan has "
                                  f"{planned}")
            yield DecodedImage(policy, n_images, width, height, converted)


def _seen(image: bytes, known: set[bytes] | None) -> bool:
    """Whether ``known`` holds the digest of these bytes; they join it if not (they are decoded
    next, and a failure is the record's error)."""
    if known is None:
        return False
    digest = hashlib.blake2b(image, digest_size=16).digest()
    if digest in known:
        return True
    known.add(digest)
    return False


def _decode(record: Record, name: str, data: bytes, rgb: bool, load: bool = True):
    """(width, height, the RGB image or None) of an image's bytes; decoded in full with
    ``load``, else read to its header (its size)."""
    from PIL import Image

    from vlmshard.families import to_rgb

    try:
        im = Image.open(io.BytesIO(data))
        if load:
            im.load()
    except Exception as e:  # Pillow's plugins raise many kinds on malformed data
        raise RecordError(f"{record.where}: image {name} does not decode: {e}") from e
    with im:
        return *im.size, to_rgb(im) if rgb else None


def _decoded_video(record: Record, sample: dict, video: dict, policy, data, rgb: bool,
                   segment: tuple[int, int] | None) -> DecodedVideo:
    """A video's frames, checked to be the frames, size and grid its policy samples: those of
    the temporal steps ``segment`` (first, count; None: all) decoded in full (RGB with
    ``rgb``), the others read to their headers."""
    where = f"{record.where}: video {video['item']} of sample {sample['sample_id']}"
    try:
        sampled = policy.sample_video(video["total_frames"], video["fps"], video["w"],
                                      video["h"], given=video["frame_list"])
    except Reject as e:
        raise RecordError(f"{where}: {e.message}") from e
    if list(sampled.indices) != video["indices"] or list(sampled.grid) != video["grid"]:
        raise RecordError(f"{where}: its policy samples frames {list(sampled.indices)} as grid "
                          f"{list(sampled.grid)}, the plan has {video['indices']} as "
                          f"{video['grid']}")
    per_step = len(video["frames"]) // video["grid"][0]
    first, count = (0, video["grid"][0]) if segment is None else segment
    frames = []
    for k, name in enumerate(video["frames"]):
        load = first * per_step <= k < (first + count) * per_step
        width, height, converted = _decode(record, name, next(data), rgb and load, load)
        if (width, height) != (video["w"], video["h"]):
            raise RecordError(f"{where}: frame {name} is {width}x{height}, the video "
                              f"{video['w']}x{video['h']}")
        if rgb and load:
            frames.append(converted)
    return DecodedVideo(policy, sampled, frames, segment)
