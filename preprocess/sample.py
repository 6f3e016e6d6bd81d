"""The work for one conversation row: validate, read image and video headers, count tiles and
frames, tokenize."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from vlmshard.families import ModelSpec, TilingPolicy, policy_from_dict, source_tiling
from vlmshard.rejects import Reject

from .config import DEFAULT_MAX_IMAGE_PIXELS
from .conversation import (
    EMBEDDED,
    ImageItem,
    ImageRef,
    Turn,
    VideoItem,
    VideoRef,
    parse_conversation,
)
from .cutoff import cut
from .images import read_image_header, resolve_image_path
from .schema import MAX_IMAGES_PER_SAMPLE
from .sources import Source
from .tokenize import IGNORE_INDEX, EncodedSample, TekkenEncoder, TokenizerConfig
from .videos import read_video_header, sampled_frames, video_bytes

if TYPE_CHECKING:
    from vlmshard.families.base import SampledVideo


@dataclass(frozen=True)
class SampleLimits:
    max_seq_len: int | None = None
    cutoff_len: int | None = None  # LLaMA-Factory's: longer samples are cut (``cutoff``)
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    max_video_seconds: float | None = None
    decode_videos: bool = False
    allow_outside_image_root: bool = False


@dataclass(frozen=True)
class SampleSpec:
    """How source rows become samples: the sources, model, tokenizer, tiling and limits.
    Picklable, so it ships to pool processes and Ray actors."""

    sources: tuple[Source, ...]
    model: ModelSpec
    tokenizer: TokenizerConfig
    tiling: dict
    limits: SampleLimits


def make_encoder(tokenizer: TokenizerConfig, model: ModelSpec):
    """The conversation encoder: the demo's Tekken, or the model folder's chat template."""
    if tokenizer.kind == "tekken":
        return TekkenEncoder(tokenizer)
    from .chat import ChatTemplateEncoder

    return ChatTemplateEncoder(model)


class SampleProcessor:
    """Per-process state for ``process_record`` (the tokenizer, each source's tiling)."""

    def __init__(self, spec: SampleSpec) -> None:
        self.spec = spec
        self.encoder = make_encoder(spec.tokenizer, spec.model)
        base = policy_from_dict(spec.tiling)
        self.tilings: list[TilingPolicy] = [source_tiling(base, s.max_num) for s in spec.sources]

    def process(self, source_index: int, record: dict | Reject, keep_tokens: bool) -> dict:
        """The stats row of a row of source ``source_index`` as ``read_part_rows`` yields it (a
        record, or the ``Reject`` of an unreadable row); raises ``Reject``."""
        if isinstance(record, Reject):
            raise record
        return process_record(record, self.spec.sources[source_index], self.tilings[source_index],
                              self.encoder, self.spec.limits, keep_tokens)


# The rate a frame list without an ``fps`` was sampled at: Qwen's (qwen-vl-utils' FPS).
FRAME_LIST_FPS = 2.0


def min_seq_len(turns: list[Turn], n_images: int, tiling: TilingPolicy,
                encoder) -> int:
    """A lower bound of the sample's sequence length that reads no image and tokenizes nothing:
    every image and video makes at least one tile (under every policy), and the encoder's own
    bound on its text where it has one (Tekken: no token spans more bytes than its longest)."""
    text_bound = getattr(encoder, "min_text_tokens", None)
    return n_images * tiling.tokens_per_tile + (text_bound(turns) if text_bound else 0)


def image_path(image: ImageRef, root: str, allow_outside_root: bool) -> str:
    """The stats table's ``image_paths`` entry: the resolved path or URL, or ``embedded:`` and
    the name the row gives the embedded bytes (the writer takes them from the row again)."""
    if image.embedded:
        return EMBEDDED + (image.path or "")
    return resolve_image_path(image.path, root, allow_outside_root)


def video_stats(video: VideoRef, index: int, item: int, root: str, tiling: TilingPolicy,
                limits: SampleLimits) -> tuple[dict, "SampledVideo"]:
    """A ``videos`` entry of the stats row (the files, the probe's counts and the frames the
    family's rule samples) and the ``SampledVideo`` itself; raises ``Reject``."""
    paths = [image_path(ref, root, limits.allow_outside_image_root) for ref in video.refs]
    name = f"video {index}"
    data = None
    if video.file is not None:
        ref = video.file
        where = paths[0] if not ref.embedded else f"embedded {name}" + (
            f" ({ref.path})" if ref.path else "")
        data = video_bytes(where, ref.data)
        header = read_video_header(where, data, limits.max_video_seconds)
        frames, fps, width, height = header.frames, header.fps, header.width, header.height
        sizes = [header.bytes]
    else:
        headers = [read_image_header(f"embedded {name} frame {k}" if ref.embedded else path,
                                     limits.max_image_pixels, ref.data)
                   for k, (ref, path) in enumerate(zip(video.frames, paths))]
        shapes = {(h.width, h.height) for h in headers}
        if len(shapes) > 1:
            raise Reject("corrupt_video", f"{name}: its frames differ in size "
                                          f"({', '.join(f'{w}x{h}' for w, h in sorted(shapes))})")
        (width, height), = shapes
        frames, fps = len(headers), video.fps or FRAME_LIST_FPS
        if limits.max_video_seconds is not None and frames / fps > limits.max_video_seconds:
            raise Reject("video_too_long", f"{name}: {frames} frames at {fps:g} fps run "
                                           f"{frames / fps:.1f} s, over --max-video-seconds "
                                           f"{limits.max_video_seconds:g}")
        sizes = [h.bytes for h in headers]
    try:
        sampled = tiling.sample_video(frames, fps, width, height, given=video.file is None)
    except Reject as e:  # bad_aspect_ratio: name the video
        raise Reject(e.reason, f"{name}: {e.message}") from e
    if data is not None and limits.decode_videos:  # what the writer will decode, decoded now
        for _ in sampled_frames(data, list(sampled.indices), where):
            pass
    return {"paths": paths, "frame_list": video.file is None,
            "frames": list(sampled.indices), "total_frames": frames,
            "fps": fps, "w": width, "h": height, "grid": list(sampled.grid),
            "tiles": sampled.tiles, "tokens": sampled.tokens,
            "seconds_per_step": sampled.seconds_per_step, "bytes": sizes, "item": item}, sampled


def process_record(record: dict, source: Source, tiling: TilingPolicy, encoder,
                   limits: SampleLimits, keep_tokens: bool) -> dict:
    """One stats row (Contract 1 of ``docs/design.md``, without ``sample_id`` and ``row``) for a
    record of ``source``; raises ``Reject``.

    Cheap checks first: a row doomed by its fields, its text or its image count (10,000 images,
    a 10 MB turn) is rejected before any image is read or any text tokenized."""
    conversation = parse_conversation(record, source.format)
    turns, images, videos = conversation.turns, conversation.images, conversation.videos
    if len(images) + len(videos) > MAX_IMAGES_PER_SAMPLE:
        raise Reject("too_many_images", f"{len(images):,} images and {len(videos):,} videos; a "
                                        f"sample holds at most {MAX_IMAGES_PER_SAMPLE:,}")
    if videos and not encoder.takes_videos:
        raise Reject("unsupported_video", f"{len(videos)} video(s), and {encoder.name} takes "
                                          "none (its family has no video layout, or its "
                                          "tokenizer lacks the layout's tokens)")
    paths = [image_path(im, source.image_root, limits.allow_outside_image_root) for im in images]
    if limits.max_seq_len is not None and limits.cutoff_len is None:
        bound = min_seq_len(turns, len(images) + len(videos), tiling, encoder)
        if bound > limits.max_seq_len:
            chars = sum(len(text) for turn in turns for text in turn.texts)
            raise Reject("too_long", f"sequence length at least {bound} > --max-seq-len "
                                     f"{limits.max_seq_len} (a bound from {len(images)} image(s) "
                                     f"and {chars:,} characters of text, before reading images "
                                     "or tokenizing)")
    headers = [read_image_header(f"embedded image {k}" + (f" ({im.path})" if im.path else "")
                                 if im.embedded else path, limits.max_image_pixels, im.data)
               for k, (im, path) in enumerate(zip(images, paths))]
    tiles = []
    for header in headers:
        try:
            tiles.append(tiling.tiles(header.width, header.height, len(headers)))
        except Reject as e:  # bad_aspect_ratio: name the image
            raise Reject(e.reason, f"image {header.path}: {e.message}") from e
    items = [isinstance(p, VideoItem) for t in turns for p in t.content
             if isinstance(p, ImageItem)]  # per image or video item in order: a video?
    order = [k for k, is_video in enumerate(items) if is_video]
    video_rows, sampled = zip(*[video_stats(v, k, order[k], source.image_root, tiling, limits)
                                for k, v in enumerate(videos)]) if videos else ((), ())
    image_tokens = [t * tiling.tokens_per_tile for t in tiles]
    cutting = limits.cutoff_len is not None
    encoded = encoder.encode(turns, image_tokens, keep_tokens or cutting, list(sampled),
                             conversation.tools)
    if cutting:
        ids, labels = cut(encoded.input_ids, encoded.labels, encoder.media_ids,
                          limits.cutoff_len)
        visual = len(encoded.input_ids) - encoded.text_tokens
        encoded = EncodedSample(text_tokens=len(ids) - visual,
                                loss_tokens=sum(label != IGNORE_INDEX for label in labels),
                                input_ids=ids if keep_tokens else None,
                                labels=labels if keep_tokens else None)
    if encoded.loss_tokens == 0:
        raise Reject("no_assistant_turn", "the assistant turns are empty")
    video_tokens = sum(v["tokens"] for v in video_rows)
    seq_len = encoded.text_tokens + sum(image_tokens) + video_tokens
    if limits.max_seq_len is not None and seq_len > limits.max_seq_len:
        raise Reject("too_long", f"sequence length {seq_len} > --max-seq-len {limits.max_seq_len}")
    row = {
        "source": source.name,
        "n_images": len(headers),
        "image_tiles": tiles,
        "vit_tiles": sum(tiles) + sum(v["tiles"] for v in video_rows),
        "text_tokens": encoded.text_tokens,
        "seq_len": seq_len,
        "loss_tokens": encoded.loss_tokens,
        "image_paths": paths,
        "image_sizes": [{"w": h.width, "h": h.height} for h in headers],
        "image_bytes": [h.bytes for h in headers],
        "videos": list(video_rows),
    }
    if keep_tokens:
        row["input_ids"] = encoded.input_ids
        row["labels"] = encoded.labels
    return row
