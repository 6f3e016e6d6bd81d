"""The work for one conversation row: validate, read image headers, count tiles, tokenize."""

from __future__ import annotations

from dataclasses import dataclass

from vlmshard.families import ModelSpec, TilingPolicy, policy_from_dict, source_tiling
from vlmshard.rejects import Reject

from .config import DEFAULT_MAX_IMAGE_PIXELS
from .images import read_image_header, resolve_image_path
from .schema import MAX_IMAGES_PER_SAMPLE
from .sources import Source
from .tokenize import IMAGE_PLACEHOLDER, ROLES, TekkenEncoder, TokenizerConfig


@dataclass(frozen=True)
class SampleLimits:
    max_seq_len: int | None = None
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
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
        source = self.spec.sources[source_index]
        return process_record(record, source.name, source.image_root, self.tilings[source_index],
                              self.encoder, self.spec.limits, keep_tokens)


def parse_turns(record: dict) -> list[tuple[str, str]]:
    """(role, text) turns with roles normalized to system/user/assistant; raises ``Reject``."""
    conversations = record.get("conversations")
    if conversations is None:
        raise Reject("missing_field", "no 'conversations' field")
    if not isinstance(conversations, list) or not conversations:
        raise Reject("bad_field", "'conversations' must be a non-empty list of turns")
    turns = []
    for i, turn in enumerate(conversations):
        if not isinstance(turn, dict) or "from" not in turn or "value" not in turn:
            raise Reject("missing_field", f"turn {i} lacks 'from' or 'value'")
        role = ROLES.get(turn["from"]) if isinstance(turn["from"], str) else None
        if role is None:
            raise Reject("bad_role", f"turn {i} is from {turn['from']!r}; expected one of "
                                     f"{', '.join(ROLES)}")
        text = turn["value"]
        if not isinstance(text, str):
            raise Reject("bad_field", f"turn {i} 'value' is a {type(text).__name__}, not text")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise Reject("undecodable_text", f"turn {i} has text that is not valid UTF-8: {e}")
        if "\0" in text:
            raise Reject("nul_in_text", f"turn {i} holds a NUL character at position "
                                        f"{text.index(chr(0))}: binary or UTF-16 data read as text")
        turns.append((role, text))
    if not any(role == "assistant" for role, _ in turns):
        raise Reject("no_assistant_turn", "no gpt/assistant turn to supervise")
    if not any(role == "assistant" and text.strip() for role, text in turns):
        raise Reject("no_assistant_turn", "every gpt/assistant turn is empty or blank")
    return turns


def parse_images(record: dict) -> list[str]:
    images = record.get("image", record.get("images"))
    if images is None:
        return []
    if isinstance(images, str):
        images = [images]
    if not isinstance(images, list) or not all(isinstance(p, str) and p for p in images):
        raise Reject("bad_field", "'image' must be a path or a list of paths")
    for k, path in enumerate(images):
        if "\0" in path:
            raise Reject("nul_in_text", f"image {k} path {path!r} holds a NUL character")
        try:
            path.encode("utf-8")
        except UnicodeEncodeError as e:
            raise Reject("undecodable_text", f"image {k} path {path!r} is not valid UTF-8: {e}")
    return images


def match_placeholders(turns: list[tuple[str, str]], n_images: int) -> list[tuple[str, str]]:
    """Check one ``<image>`` per image. A single image with no placeholder is put before the
    first user turn, as InternVL's loader does."""
    count = sum(text.count(IMAGE_PLACEHOLDER) for _, text in turns)
    if count == n_images:
        return turns
    if count == 0 and n_images == 1:
        first_user = next(i for i, (role, _) in enumerate(turns) if role != "system")
        role, text = turns[first_user]
        return turns[:first_user] + [(role, f"{IMAGE_PLACEHOLDER}\n{text}")] + turns[first_user + 1:]
    raise Reject("image_count_mismatch",
                 f"{count} <image> placeholder(s) for {n_images} image(s)")


def min_seq_len(turns: list[tuple[str, str]], n_images: int, tiling: TilingPolicy,
                encoder) -> int:
    """A lower bound of the sample's sequence length that reads no image and tokenizes nothing:
    every image makes at least one tile (under both policies), and the encoder's own bound on
    its text where it has one (Tekken: no token spans more bytes than its longest)."""
    text_bound = getattr(encoder, "min_text_tokens", None)
    return n_images * tiling.tokens_per_tile + (text_bound(turns) if text_bound else 0)


def process_record(record: dict, source_name: str, image_root: str, tiling: TilingPolicy,
                   encoder, limits: SampleLimits,
                   keep_tokens: bool) -> dict:
    """One stats row (Contract 1 of ``docs/design.md``, without ``sample_id``) for a record;
    raises ``Reject``.

    Cheap checks first: a row doomed by its fields, its text or its image count (10,000 images,
    a 10 MB turn) is rejected before any image is read or any text tokenized."""
    turns = parse_turns(record)
    images = parse_images(record)
    turns = match_placeholders(turns, len(images))
    if len(images) > MAX_IMAGES_PER_SAMPLE:
        raise Reject("too_many_images", f"{len(images):,} images; a sample holds at most "
                                        f"{MAX_IMAGES_PER_SAMPLE:,}")
    paths = [resolve_image_path(p, image_root, limits.allow_outside_image_root) for p in images]
    if limits.max_seq_len is not None:
        bound = min_seq_len(turns, len(images), tiling, encoder)
        if bound > limits.max_seq_len:
            raise Reject("too_long", f"sequence length at least {bound} > --max-seq-len "
                                     f"{limits.max_seq_len} (a bound from {len(images)} image(s) "
                                     f"and {sum(len(t) for _, t in turns):,} characters of text, "
                                     "before reading images or tokenizing)")
    headers = [read_image_header(p, limits.max_image_pixels) for p in paths]
    tiles = []
    for header in headers:
        try:
            tiles.append(tiling.tiles(header.width, header.height, len(headers)))
        except Reject as e:  # bad_aspect_ratio: name the image
            raise Reject(e.reason, f"image {header.path}: {e.message}") from None
    image_tokens = [t * tiling.tokens_per_tile for t in tiles]
    encoded = encoder.encode(turns, image_tokens, keep_tokens)
    if encoded.loss_tokens == 0:
        raise Reject("no_assistant_turn", "the assistant turns are empty")
    seq_len = encoded.text_tokens + sum(image_tokens)
    if limits.max_seq_len is not None and seq_len > limits.max_seq_len:
        raise Reject("too_long", f"sequence length {seq_len} > --max-seq-len {limits.max_seq_len}")
    row = {
        "source": source_name,
        "n_images": len(headers),
        "image_tiles": tiles,
        "vit_tiles": sum(tiles),
        "text_tokens": encoded.text_tokens,
        "seq_len": seq_len,
        "loss_tokens": encoded.loss_tokens,
        "image_paths": paths,
        "image_sizes": [{"w": h.width, "h": h.height} for h in headers],
    }
    if keep_tokens:
        row["input_ids"] = encoded.input_ids
        row["labels"] = encoded.labels
    return row
