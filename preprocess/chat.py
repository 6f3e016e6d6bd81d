"""A model folder's chat template and tokenizer: a conversation becomes ids and labels exactly as
``transformers`` renders and tokenizes it, except that data text never becomes control tokens.

1. Messages in ``transformers``' multimodal form (``conversation``), text as written but where
   the template would change it unseen: the data's line break after an ``<image>`` is dropped
   where the template writes its own (InternVL), text is trimmed where the template trims it
   (Qwen3.5, Gemma 3). Both are found by rendering probe conversations once.
2. ``apply_chat_template`` renders them with a marker in place of each text item and tool call
   name, so template text and data text are told apart by position. A template that rewrites
   data text (Qwen3.5 moves an answer's ``<think>`` block) is a ``template_error``: rendered
   again with the text in place, it must give the marked rendering with the text put back.
3. The template text is split at special tokens; each image or video placeholder becomes the
   family's expansion; the rest, template and data text together, is encoded with
   special-token parsing off (a literal ``<|im_end|>`` in a user turn stays text).
4. Labels: assistant text and the template's tokens after it up to the first special token (the
   end of turn). A turn of tool calls alone is supervised from where the generation prompt
   ends (Qwen's ``<tool_call>`` included), as the model writes it.

For data without special-token text the ids equal ``apply_chat_template(tokenize=True)`` with
each placeholder expanded (``tests/test_families.py``, per family; ``docs/families.md``).
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import jinja2

from vlmshard.families import ModelFolderError, ModelSpec, family
from vlmshard.rejects import Reject

from .conversation import ImageItem, Turn, VideoItem
from .tokenize import IGNORE_INDEX, EncodedSample

if TYPE_CHECKING:
    from vlmshard.families.base import SampledVideo

log = logging.getLogger(__name__)

_MARK = "\ue000{}\ue001"  # private-use code points: never produced by a template
_MARKS = re.compile("\ue000(\\d+)\ue001")
PAD_TOKENS = ("<|endoftext|>", "<pad>")  # when the tokenizer names no pad_token
# Pre-tokenizers that pass every character on (they split, isolate or merge; a Split or
# Punctuation whose behavior is "Removed" drops text, as Whitespace and BertPreTokenizer do).
_KEEPS_TEXT = {"ByteLevel", "Metaspace", "Digits", "UnicodeScripts", "Split", "Punctuation"}
# What rendering a chat template raises for a conversation it refuses: jinja's own errors
# (``raise_exception``, an undefined name, a filter's bad argument), TypeError from an operation
# on a value of the wrong kind (a string joined to a list of items), and ValueError from
# ``transformers``' checks of the messages.
TEMPLATE_ERRORS = (jinja2.TemplateError, TypeError, ValueError)


@dataclass(frozen=True)
class TextRules:
    """How a template treats the text around its items, as ``to_messages`` must mirror it."""

    break_after_image: bool = False  # it writes whitespace after an image item
    trim_items: bool = False  # it trims each text item (``item.text | trim``)
    trim_content: bool = False  # it trims each message's rendered content
    trim_system: bool = False  # either also for the system turn (Gemma 3 writes it as given)


def _trimmed(parts: list, rules: TextRules, role: str) -> list:
    """A turn's parts (text and images) with the whitespace the template would trim removed."""
    if role == "system" and not rules.trim_system:
        return parts
    if rules.trim_items:
        return [p if isinstance(p, ImageItem) else p.strip() for p in parts]
    if not rules.trim_content:
        return parts
    parts = list(parts)
    for order, strip in ((range(len(parts)), str.lstrip),
                         (range(len(parts) - 1, -1, -1), str.rstrip)):
        for i in order:  # from the edge inward, through text that trims to nothing
            if isinstance(parts[i], ImageItem):
                break
            parts[i] = strip(parts[i])
            if parts[i]:
                break
    return parts


class Text(NamedTuple):
    """The data text one marker stands for. ``opens_call``: a tool call's name that opens its
    turn (the turn has no text), so the template's text before it in the turn is the call's."""

    role: str
    text: str
    opens_call: bool = False


def to_messages(turns: list[Turn], rules: TextRules = TextRules(), marked: bool = True
                ) -> tuple[list[dict], list[Text]]:
    """(messages with a marker per text item and tool call name, the text of each marker in
    order), with the template's ``rules`` applied to the text; ``marked=False``: the text in
    place."""
    messages, texts = [], []
    for turn in turns:
        content: list[dict] = []
        after_placeholder = False
        parts = []
        for part in turn.content:
            if not isinstance(part, ImageItem) and after_placeholder and \
                    rules.break_after_image and part.startswith("\n"):
                part = part[1:]
            after_placeholder = isinstance(part, ImageItem) and part.placeholder
            parts.append(part)
        for part in _trimmed(parts, rules, turn.role):
            if isinstance(part, ImageItem):
                content.append({"type": "video" if isinstance(part, VideoItem) else "image"})
            elif part:
                content.append({"type": "text",
                                 "text": _MARK.format(len(texts)) if marked else part})
                texts.append(Text(turn.role, part))
        if not turn.typed:
            content = content[0]["text"] if content else ""
        message = {"role": turn.role, "content": content}
        if turn.tool_calls:
            opens = not content  # no text of the turn before its first call
            message["tool_calls"] = []
            for k, call in enumerate(turn.tool_calls):
                name = _MARK.format(len(texts)) if marked else call.name
                message["tool_calls"].append({"type": "function", "function": {
                    "name": name, "arguments": call.arguments}})
                texts.append(Text(turn.role, call.name, opens_call=opens and k == 0))
        messages.append(message)
    return messages, texts


class ChatTemplateEncoder:
    """Turns (role, text) turns plus per-image token counts into ids and labels (see above)."""

    def __init__(self, model: ModelSpec) -> None:
        from tokenizers import Tokenizer
        from transformers import AutoTokenizer

        self.model = model
        try:
            self.hf = AutoTokenizer.from_pretrained(model.path, local_files_only=True)
            self.backend = Tokenizer.from_file(os.path.join(model.path, "tokenizer.json"))
        except Exception as e:  # tokenizers and transformers raise many kinds
            raise ModelFolderError(f"{model.path}: the tokenizer does not load: {e}") from e
        if not self.hf.chat_template:
            raise ModelFolderError(f"{model.path}: the tokenizer has no chat_template (in "
                                   "tokenizer_config.json or chat_template.jinja)")
        self.backend.encode_special_tokens = True  # data text stays text
        self.special = {t.content: i for i, t in self.backend.get_added_tokens_decoder().items()
                        if t.special}
        layout = model.layout
        for token in (layout.placeholder, layout.token, *layout.prefix, *layout.suffix):
            if token not in self.special:
                raise ModelFolderError(f"{model.path}: the tokenizer has no special token "
                                       f"{token!r}, which the {model.family} image layout needs")
        self._split = re.compile("(" + "|".join(
            re.escape(t) for t in sorted(self.special, key=len, reverse=True)) + ")")
        self.image_token_id = self.special[layout.token]
        self._placeholder = layout.placeholder
        self._layout = layout
        video = model.video_layout
        missing = [t for t in (video.placeholder, video.token, *video.prefix, *video.suffix)
                   if t not in self.special] if video is not None else []
        if missing:
            log.warning("%s: the tokenizer has no special token %r, which the %s video layout "
                        "needs: videos are rejected", model.path, missing[0], model.family)
        self._video_layout = None if missing else video
        self._family = family(model.family)
        # (prefix ids, token id, suffix ids) of an image's and a video's runs
        self._image_run = self._run_ids(layout)
        self._video_run = self._run_ids(video) if self._video_layout else None
        # what --cutoff-len never cuts: the runs' tokens
        self.media_ids = frozenset(i for run in (self._image_run, self._video_run or ([], 0, []))
                                   for i in (*run[0], run[1], *run[2]))
        self._max_token_chars = _max_token_chars(self.backend)
        self._rules = TextRules(self._template_breaks_after_image(), *self._template_trims())
        self._reply_prompt = self._generation_prompt()

    def _run_ids(self, layout) -> tuple[list[int], int, list[int]]:
        return ([self.special[t] for t in layout.prefix], self.special[layout.token],
                [self.special[t] for t in layout.suffix])

    @property
    def takes_videos(self) -> bool:
        return self._video_layout is not None

    @property
    def video_token_id(self) -> int | None:
        """The token a video's embeddings fill (InternVL: the image token)."""
        return None if self._video_layout is None else self.special[self._video_layout.token]

    @property
    def name(self) -> str:
        return f"the {self.model.family} family ({self.model.model_type})"

    @property
    def pad_token_id(self) -> int:
        for token in (self.hf.pad_token, *PAD_TOKENS):
            if token is not None and (i := self.backend.token_to_id(token)) is not None:
                return i
        return 0

    def _template_breaks_after_image(self) -> bool:
        """Whether the template puts whitespace right after an image item (after the family's
        image tokens): rendered once for a probe conversation."""
        probe = [{"role": "user", "content": [{"type": "image"},
                                              {"type": "text", "text": _MARK.format(0)}]},
                 {"role": "assistant", "content": _MARK.format(1)}]
        try:
            rendered = self.hf.apply_chat_template(probe, tokenize=False)
        except TEMPLATE_ERRORS:  # a template that refuses the probe: keep the text as written
            return False
        start, end = rendered.find(self._placeholder), rendered.find(_MARK.format(0))
        if start < 0 or end < start:  # no image item before the text: nothing after one
            return False
        after = rendered[start + len(self._placeholder):end]
        gap = "".join(self._split.split(after)[0::2])  # without the family's image tokens
        return gap != "" and gap.isspace()

    def _generation_prompt(self) -> str:
        """What ``add_generation_prompt`` adds after its last special token (Qwen's
        ``assistant\\n``): what a reply's turn opens with that the model does not write."""
        probe = [{"role": "user", "content": _MARK.format(0)}]
        try:
            without = self.hf.apply_chat_template(probe, tokenize=False)
            added = self.hf.apply_chat_template(probe, tokenize=False, add_generation_prompt=True)
        except TEMPLATE_ERRORS:  # a template that refuses the probe: the whole turn is written
            return ""
        return self._split.split(added[len(without):])[-1] if added.startswith(without) else ""

    def _template_trims(self) -> tuple[bool, bool, bool]:
        """(trims each text item, trims each message's content, trims the system turn too),
        from where the whitespace around a probe's text items survives: a template that trims
        content strips only the outer edges of [text, image, text]."""
        spaced = [f" {_MARK.format(k)} " for k in range(4)]

        def kept(probe: list[dict], k: int) -> tuple[bool, bool] | None:
            try:
                rendered = self.hf.apply_chat_template(probe, tokenize=False)
            except TEMPLATE_ERRORS:  # a template that refuses the probe: no trimming known
                return None
            return f" {_MARK.format(k)}" in rendered, f"{_MARK.format(k)} " in rendered

        turns = [{"role": "user", "content": [{"type": "text", "text": spaced[0]},
                                              {"type": "image"},
                                              {"type": "text", "text": spaced[1]}]},
                 {"role": "assistant", "content": spaced[2]}]
        first, second = kept(turns, 0), kept(turns, 1)
        if first is None:
            return False, False, False
        inner = not first[1] and not second[0]  # whitespace between the items went
        outer = not first[0] and not second[1]
        system = kept([{"role": "system", "content": spaced[3]}, *turns], 3)
        return inner, outer and not inner, system is not None and not any(system)

    def min_text_tokens(self, turns: list[Turn]) -> int:
        """A lower bound of ``encode``'s ``text_tokens`` that renders and tokenizes nothing (a 10
        MB turn takes seconds), or 0 where the tokenizer may drop or fuse text: each token of a
        BPE that keeps every character stands for at most its vocabulary entry's length in
        normalized characters (a byte-level entry's characters are bytes)."""
        if self._max_token_chars is None:
            return 0
        normalizer = self.backend.normalizer
        chars = 0
        for _, text, _ in to_messages(turns, self._rules)[1]:
            # Less one per text: normalization may join its edge to the template's next character.
            chars += len(normalizer.normalize_str(text) if normalizer else text) - 1
        return max(0, chars) // self._max_token_chars

    def render(self, turns: list[Turn], tools: list[dict] = ()
               ) -> tuple[list[str], list[Text]]:
        """The template's text between the markers (one more than texts), and the texts."""
        messages, texts = to_messages(turns, self._rules)
        # the text as written: the template's own trimming must give what the markers got
        as_written = to_messages(turns, TextRules(break_after_image=self._rules.break_after_image),
                                 False)[0]
        try:
            rendered = self.hf.apply_chat_template(messages, tools=tools or None, tokenize=False)
            in_place = self.hf.apply_chat_template(as_written, tools=tools or None,
                                                   tokenize=False)
            ignored = bool(tools) and rendered == self.hf.apply_chat_template(messages,
                                                                             tokenize=False)
        except TEMPLATE_ERRORS as e:
            raise Reject("template_error",
                         f"the chat template refuses this conversation: {e}") from e
        if ignored:
            raise Reject("template_error", f"the row has {len(tools)} tool(s) and the chat "
                                           "template takes none (it renders the same without)")
        pieces = _MARKS.split(rendered)
        order = [int(k) for k in pieces[1::2]]
        if any(t.opens_call for t in texts) and not any(texts[k].opens_call for k in order):
            raise Reject("template_error", "the chat template does not render an assistant's "
                                           "tool calls (function_call turns)")
        if order != list(range(len(texts))):
            raise Reject("template_error", "the chat template drops, repeats or reorders message "
                                           "text; vlmshard needs each text once, in order")
        template = pieces[0::2]
        if in_place != "".join(p + t.text for p, t in zip(template, texts)) + template[-1]:
            raise Reject("template_error", "the chat template rewrites this conversation's text "
                                           "(e.g. a <think> block in an answer becomes its "
                                           "reasoning), so its text and the template's cannot "
                                           "be told apart")
        return template, texts

    def encode(self, turns: list[Turn], image_tokens: list[int], keep_tokens: bool,
               videos: list["SampledVideo"] = (), tools: list[dict] = ()) -> EncodedSample:
        """``image_tokens[k]``: how many ``token`` the k-th image takes; ``videos``: each video
        as its family's rule sampled it (its tokens and text: ``Family.video_pieces``);
        ``tools``: the template's tools. ``text_tokens`` counts every other token (the
        template's, the text's, the image and video prefixes and suffixes, a video's frame
        texts)."""
        template, texts = self.render(turns, tools)
        video = self._video_layout
        if video is not None and any(video.replaces):  # its expansion brings its own wrapper
            wrapped = video.replaces[0] + video.placeholder + video.replaces[1]
            template = [piece.replace(wrapped, video.placeholder) for piece in template]
        seq = _Sequence(self.backend)
        images, video_items = iter(image_tokens), iter(videos)
        n_images = n_videos = 0
        supervise = False  # after assistant text, until the end-of-turn token
        for k, piece in enumerate(template):
            for j, part in enumerate(self._split.split(piece)):
                if j % 2 == 0:
                    seq.text(part, supervise)
                elif part == self._placeholder:
                    seq.run(self._image_run, self._layout.pieces(_next(images, "image")))
                    n_images += 1
                elif video is not None and part == video.placeholder:
                    sampled = _next(video_items, "video")
                    seq.run(self._video_run, self._family.video_pieces(sampled, video))
                    n_videos += 1
                else:
                    seq.token(self.special[part], supervise)
                    supervise = False
            if k < len(texts):
                role, text, opens_call = texts[k]
                if opens_call:
                    seq.supervise_after(self._reply_prompt)
                seq.text(text, role == "assistant")
                supervise = role == "assistant"
        seq.flush()
        if n_images != len(image_tokens) or n_videos != len(videos):
            raise Reject("template_error", f"the chat template rendered {n_images} image and "
                                           f"{n_videos} video placeholder(s) for "
                                           f"{len(image_tokens)} image(s) and {len(videos)} "
                                           "video(s)")
        visual = sum(image_tokens) + sum(v.tokens for v in videos)
        return EncodedSample(text_tokens=len(seq.ids) - visual,
                             loss_tokens=sum(label != IGNORE_INDEX for label in seq.labels),
                             input_ids=seq.ids if keep_tokens else None,
                             labels=seq.labels if keep_tokens else None)


def _next(items, what: str):
    """The next image or video for a placeholder the template rendered."""
    item = next(items, None)
    if item is None:
        raise Reject("template_error", f"the chat template renders more {what} placeholders "
                                       f"than the sample has {what}s")
    return item


class _Sequence:
    """A sample's ids and labels as ``encode`` builds them: text pieces (template and data, each
    supervised or not) gather between special tokens and media runs, and are encoded together,
    as ``tokenizers`` encodes the whole string."""

    def __init__(self, backend) -> None:
        self.backend = backend
        self.ids: list[int] = []
        self.labels: list[int] = []
        self.segment: list[tuple[str, bool]] = []  # text since the last token or run

    def text(self, piece: str, supervised: bool) -> None:
        self.segment.append((piece, supervised))

    def supervise_after(self, prompt: str) -> None:
        """Supervise the template text since the last special token, past its part in common
        with ``prompt`` (a generation prompt's text: what the model does not write)."""
        head = self.segment.pop()[0]
        n = len(os.path.commonprefix([head, prompt]))
        self.segment += [(head[:n], False), (head[n:], True)]

    def flush(self) -> None:
        text = "".join(t for t, _ in self.segment)
        if text:
            enc = self.backend.encode(text, add_special_tokens=False)
            labels = [IGNORE_INDEX] * len(enc.ids)
            start = 0
            for piece, supervised in self.segment:
                if supervised and piece:
                    lo, hi = _tokens_starting_in(enc, start, start + len(piece))
                    labels[lo:hi] = enc.ids[lo:hi]
                start += len(piece)
            self.ids.extend(enc.ids)
            self.labels.extend(labels)
        self.segment.clear()

    def token(self, token: int, supervised: bool) -> None:
        """A special token of the template (supervised: the end of an assistant's turn)."""
        self.flush()
        self.ids.append(token)
        self.labels.append(token if supervised else IGNORE_INDEX)

    def run(self, run_ids: tuple[list[int], int, list[int]], pieces: list[str | int]) -> None:
        """An image's or video's pieces: text goes with the text next to it; each run of the
        layout's token, in its prefix and suffix, is unsupervised."""
        prefix, token, suffix = run_ids
        for piece in pieces:
            if isinstance(piece, str):
                self.text(piece, False)
                continue
            self.flush()
            run = prefix + [token] * piece + suffix
            self.ids.extend(run)
            self.labels.extend([IGNORE_INDEX] * len(run))


def _max_token_chars(backend) -> int | None:
    """The longest vocabulary entry (added tokens too), where it bounds how much text one token
    stands for: a BPE whose pre-tokenizer keeps every character and that never fuses unknown
    characters into one token. None otherwise."""
    model = json.loads(backend.model.__getstate__())
    if model.get("type") != "BPE" or (model.get("unk_token") is not None
                                      and model.get("fuse_unk") and not model.get("byte_fallback")):
        return None
    pre = backend.pre_tokenizer

    def keeps(config: dict) -> bool:
        if config["type"] == "Sequence":
            return all(keeps(c) for c in config["pretokenizers"])
        return config["type"] in _KEEPS_TEXT and config.get("behavior") != "Removed"

    if pre is not None and not keeps(json.loads(pre.__getstate__())):
        return None
    return max(map(len, backend.get_vocab(with_added_tokens=True)), default=0) or None


def _tokens_starting_in(enc, lo: int, hi: int) -> tuple[int, int]:
    """The tokens of ``enc`` that start at a character in [lo, hi): a token straddling into the
    span from before belongs to what precedes it (the template's text)."""
    first, last = enc.char_to_token(lo), enc.char_to_token(hi - 1)
    if first is None or last is None:  # characters a normalizer dropped: scan the offsets
        starts = [start for start, _ in enc.offsets]
        inside = [i for i, start in enumerate(starts) if lo <= start < hi]
        return (inside[0], inside[-1] + 1) if inside else (0, 0)
    if enc.token_to_chars(first)[0] < lo:
        first += 1
    return first, max(first, last + 1)
