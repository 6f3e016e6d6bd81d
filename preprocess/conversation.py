"""Source rows in any supported format become one internal conversation: turns of text, image
and video items, the images and videos they refer to, and the row's tools.

Formats (``RowFormat.name``; ``auto`` takes the first one whose turn list a row has): ``llava``
(``conversations`` of ``from``/``value``), ``messages`` (``role``/``content``, content a string
or ``apply_chat_template``'s typed items, OpenAI's ``image_url`` too), ``texts`` (turn pairs,
their images first in the first user turn, as Idefics3/SmolVLM's fine-tuning puts them) and
``alpaca`` (LLaMA-Factory's ``data/converter.py``). Column, key and role names are renamed per
source (``RowFormat``), as LLaMA-Factory's ``dataset_info.json`` does.

A row's ``system`` column is its system prompt unless its turns open with one; its ``tools`` go
to the template, a bare function definition wrapped as LLaMA-Factory's tool formatters wrap it.
A ``function_call`` turn is an assistant turn of ``tool_calls`` (its text their JSON), an
``observation`` turn a ``tool`` turn, as LLaMA-Factory's converter maps them. Audio is never
dropped: a row with any is an ``unsupported_audio`` reject.

``<image>`` and ``<video>`` in text take the next of the row's ``images`` and ``videos``; an
image is a path, URL, ``data:`` URI or ``{"bytes", "path"}``, a video one of those or a list of
frames. Text is kept as written (the line break after a placeholder is the chat template's
business, ``vlmshard.preprocess.chat``). ``docs/formats.md`` says it all with examples.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from dataclasses import dataclass, field, replace

from vlmshard.errors import ConfigError
from vlmshard.rejects import Reject

IMAGE_PLACEHOLDER = "<image>"
VIDEO_PLACEHOLDER = "<video>"
_PLACEHOLDERS = re.compile(f"({IMAGE_PLACEHOLDER}|{VIDEO_PLACEHOLDER})")
AUDIO_PLACEHOLDER = "<audio>"  # LLaMA-Factory's
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
         "system": "system", "observation": "tool", "tool": "tool",
         "function_call": "function_call"}
# What a source's role may stand for: function_call is an assistant turn holding tool calls.
ROLE_KINDS = ("user", "assistant", "system", "tool", "function_call")
FORMATS = {
    # name: (turn list columns, role keys, content keys), each tried in order
    "auto": (("conversations", "messages", "texts"), ("from", "role"), ("value", "content")),
    "llava": (("conversations",), ("from",), ("value",)),
    "messages": (("messages",), ("role",), ("content",)),
    "texts": (("texts",), (), ()),  # turn pairs: {"user", "assistant"(, "system")} per element
    "alpaca": ((), (), ()),  # one exchange per row, in the columns ALPACA_COLUMNS names
}
# LLaMA-Factory's alpaca columns and their default names; history is read where it is named.
ALPACA_COLUMNS = {"prompt": "instruction", "query": "input", "response": "output",
                  "history": None}
PAIR_ROLES = ("system", "user", "assistant")
IMAGE_COLUMNS = ("images", "image")
VIDEO_COLUMNS = ("videos", "video")
AUDIO_COLUMNS = ("audios", "audio")
# What RowFormat.columns renames
COLUMN_KEYS = ("messages", "images", "videos", "audios", "role", "content", "system", "tools",
               *ALPACA_COLUMNS)
EMBEDDED = "embedded:"  # stats image_paths prefix of an image whose bytes are in the source row
# How rows become text, recorded by preprocess: re-tokenizing a run of another one would not give
# its ids. 2: text kept as written (the line break after <image> as the template decides).
# 3: <video> in text is a placeholder. 4: a row's system column is its system prompt, its tools
# column the template's tools. 5: function_call and observation turns are tool calls and results;
# a bare function definition is wrapped as the template's tool.
TEXT_ENCODING = 5


@dataclass(frozen=True)
class ImageItem:
    """Where an image sits in a turn. ``placeholder``: written as ``<image>`` inside text, so the
    text after it is the data's own (a template that puts its own line break after an image
    drops the data's); otherwise a typed item, or the image InternVL's rule puts first."""

    placeholder: bool


@dataclass(frozen=True)
class VideoItem(ImageItem):
    """Where a video sits in a turn: a ``<video>`` placeholder or a typed video item."""


@dataclass(frozen=True)
class ToolCall:
    """A function an assistant turn calls: its name and arguments (as the data gives them: an
    object, or a JSON string)."""

    name: str
    arguments: object


@dataclass(frozen=True)
class Turn:
    """One message: its role (system/user/assistant/tool) and its content in order. ``typed``:
    the source gave a content list (or the turn holds images), so the template gets a list.
    ``tool_calls``: an assistant turn's calls, after its content."""

    role: str
    content: tuple[str | ImageItem, ...]
    typed: bool
    tool_calls: tuple[ToolCall, ...] = ()

    @property
    def texts(self) -> list[str]:
        return [part for part in self.content if isinstance(part, str)]


@dataclass(frozen=True)
class ImageRef:
    """An image of a row: embedded ``data`` (bytes win), else ``path`` (a path or URL as
    written). ``path`` may name embedded bytes' original file."""

    path: str | None = None
    data: bytes | None = field(default=None, repr=False)

    @property
    def embedded(self) -> bool:
        return self.data is not None


@dataclass(frozen=True)
class VideoRef:
    """A video of a row: a container file (``file``), or frame images taken as sampled
    (``frames``) at ``fps`` where the row states it."""

    file: ImageRef | None = None
    frames: tuple[ImageRef, ...] = ()
    fps: float | None = None

    @property
    def refs(self) -> tuple[ImageRef, ...]:
        """The files it reads: the container, or each frame."""
        return (self.file,) if self.file is not None else self.frames


@dataclass(frozen=True)
class Conversation:
    turns: list[Turn]
    images: list[ImageRef]
    videos: list[VideoRef] = field(default_factory=list)
    tools: list[dict] = field(default_factory=list)  # function definitions for the template


@dataclass(frozen=True)
class RowFormat:
    """How one source's rows hold conversations: the format and any renamed columns or roles.
    Frozen and made of tuples, so a ``Source`` holding it stays hashable and picklable."""

    name: str = "auto"
    columns: tuple[tuple[str, str], ...] = ()  # (key in COLUMN_KEYS, the source's name for it)
    roles: tuple[tuple[str, str], ...] = ()  # (the source's role name, user/assistant/system)

    def __post_init__(self) -> None:
        if self.name not in FORMATS:
            raise ConfigError(f"format {self.name!r}: known formats are {', '.join(FORMATS)}")
        for key, _ in self.columns:
            if key not in COLUMN_KEYS:
                raise ConfigError(f"column mapping {key!r}: the keys that can be renamed are "
                                  f"{', '.join(COLUMN_KEYS)}")
        for name, role in self.roles:
            if role not in ROLE_KINDS:
                raise ConfigError(f"role mapping {name}={role}: map to "
                                  f"{', '.join(ROLE_KINDS[:-1])} or {ROLE_KINDS[-1]}")

    @classmethod
    def from_options(cls, name: str = "auto", columns: dict[str, str] | None = None,
                     roles: dict[str, str] | None = None) -> RowFormat:
        return cls(name, tuple(sorted((columns or {}).items())),
                   tuple(sorted((roles or {}).items())))

    def to_dict(self) -> dict:
        return {"name": self.name, "columns": dict(self.columns), "roles": dict(self.roles)}

    @classmethod
    def from_dict(cls, d: dict) -> RowFormat:
        return cls.from_options(d["name"], d["columns"], d["roles"])

    def _keys(self, which: str, index: int) -> tuple[str, ...]:
        renamed = dict(self.columns).get(which)
        return (renamed,) if renamed else FORMATS[self.name][index]

    @property
    def turn_columns(self) -> tuple[str, ...]:
        return self._keys("messages", 0)

    @property
    def role_keys(self) -> tuple[str, ...]:
        return self._keys("role", 1)

    @property
    def content_keys(self) -> tuple[str, ...]:
        return self._keys("content", 2)

    @property
    def image_columns(self) -> tuple[str, ...]:
        renamed = dict(self.columns).get("images")
        return (renamed,) if renamed else IMAGE_COLUMNS

    @property
    def video_columns(self) -> tuple[str, ...]:
        renamed = dict(self.columns).get("videos")
        return (renamed,) if renamed else VIDEO_COLUMNS

    @property
    def audio_columns(self) -> tuple[str, ...]:
        renamed = dict(self.columns).get("audios")
        return (renamed,) if renamed else AUDIO_COLUMNS

    @property
    def system_column(self) -> str:
        return dict(self.columns).get("system", "system")

    @property
    def tools_column(self) -> str:
        return dict(self.columns).get("tools", "tools")

    def column(self, key: str) -> str | None:
        """The source's name for an alpaca column (None: history, unnamed)."""
        return dict(self.columns).get(key, ALPACA_COLUMNS[key])

    def role(self, name) -> str | None:
        if not isinstance(name, str):
            return None
        return dict(self.roles).get(name) or ROLES.get(name)


def parse_conversation(record: dict, fmt: RowFormat) -> Conversation:
    """The row's turns and images; raises ``Reject``. Cheap: reads no image."""
    audio = next((c for c in fmt.audio_columns if record.get(c)), None)
    if audio is not None:
        raise _no_audio(f"an {audio!r} column")
    image_column = next((c for c in fmt.image_columns if record.get(c) is not None), None)
    listed = _image_values(record[image_column], image_column) if image_column else []
    video_column = next((c for c in fmt.video_columns if record.get(c) is not None), None)
    listed_videos = (_video_values(record[video_column], video_column, record.get("fps"))
                     if video_column else [])
    turns: list[Turn] = []
    inline: list = []  # per image or video item in order: its own image or video, or None
    if fmt.name == "alpaca":
        new, pairs = _alpaca_turns(record, fmt), False
    else:
        raw = _turn_list(record, fmt)
        pairs = fmt.name == "texts" or (fmt.name == "auto" and _is_pair(raw[0], fmt))
        new = [t for i, message in enumerate(raw)
               for t in (_parse_pair(message, i) if pairs else [_parse_turn(message, i, fmt)])]
    system = _system_turn(record, fmt) if not new or new[0][0].role != "system" else None
    for turn, refs in ([system] if system else []) + new:
        turns.append(turn)
        inline.extend(refs)
    if any(AUDIO_PLACEHOLDER in text for t in turns for text in t.texts):
        raise _no_audio(f"an {AUDIO_PLACEHOLDER} placeholder")
    if not any(t.role == "assistant" for t in turns):
        raise Reject("no_assistant_turn", "no gpt/assistant turn to supervise")
    if not any(t.role == "assistant" and ("".join(t.texts).strip() or t.tool_calls)
               for t in turns):
        raise Reject("no_assistant_turn", "every gpt/assistant turn is empty or blank")
    kinds = [isinstance(p, VideoItem) for t in turns for p in t.content
             if isinstance(p, ImageItem)]
    turns, images = _place_images(turns, [r for r, v in zip(inline, kinds) if not v], listed,
                                  all_first=pairs, item=ImageItem)
    turns, videos = _place_images(turns, [r for r, v in zip(inline, kinds) if v],
                                  listed_videos, all_first=pairs, item=VideoItem)
    return Conversation(turns, images, videos, _tools(record, fmt.tools_column))


def _no_audio(what: str) -> Reject:
    return Reject("unsupported_audio", f"the row has audio ({what}); no vlmshard family reads "
                                       "audio")


def _turn_list(record: dict, fmt: RowFormat) -> list:
    column = next((c for c in fmt.turn_columns if record.get(c) is not None), None)
    if column is None:
        raise Reject("missing_field", f"no {_names(fmt.turn_columns)} field; the row has "
                                      f"{', '.join(map(repr, sorted(record))) or 'no fields'}")
    raw = record[column]
    if not isinstance(raw, list) or not raw:
        raise Reject("bad_field", f"{column!r} must be a non-empty list of turns")
    return raw


def _texts_turn(role: str, text, where: str) -> tuple[Turn, list[None]]:
    """A turn of text (its placeholders' images to come from the row's columns)."""
    if not isinstance(text, str):
        raise Reject("bad_field", f"{where} is a {type(text).__name__}, not text")
    turn = text_turn(role, text, where)
    return turn, [None] * sum(isinstance(p, ImageItem) for p in turn.content)


def _system_turn(record: dict, fmt: RowFormat) -> tuple[Turn, list[None]] | None:
    """The row's system column as a system turn; None where it has none or it is empty."""
    value = record.get(fmt.system_column)
    return _texts_turn("system", value, repr(fmt.system_column)) if value else None


def _tools(record: dict, column: str) -> list[dict]:
    """The row's function definitions: a JSON string (LLaMA-Factory's), a list or one object;
    none where the column is missing or empty."""
    value = record.get(column)
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else None
        except json.JSONDecodeError as e:
            raise Reject("bad_field", f"{column!r} is not JSON: {e}") from e
    value = [value] if isinstance(value, dict) else value or []
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        raise Reject("bad_field", f"{column!r} must hold function definitions (JSON objects)")
    return [t if "type" in t or "name" not in t else {"type": "function", "function": t}
            for t in value]


def _alpaca_turns(record: dict, fmt: RowFormat) -> list[tuple[Turn, list[None]]]:
    """LLaMA-Factory's alpaca row: the history's pairs, then instruction and input (the
    non-empty ones, joined by a line break) and the output."""
    turns = []
    history = record.get(fmt.column("history")) if fmt.column("history") else None
    if history is not None:
        if not isinstance(history, list) or not all(
                isinstance(p, (list, tuple)) and len(p) == 2 for p in history):
            raise Reject("bad_field", f"{fmt.column('history')!r} must be a list of "
                                      "[prompt, answer] pairs")
        for i, (prompt, answer) in enumerate(history):
            turns += [_texts_turn("user", prompt, f"history {i} prompt"),
                      _texts_turn("assistant", answer, f"history {i} answer")]
    columns = [fmt.column(k) for k in ("prompt", "query", "response")]
    if record.get(columns[0]) is None and record.get(columns[2]) is None:
        raise Reject("missing_field", f"no {columns[0]!r} or {columns[2]!r} field; the row has "
                                      f"{', '.join(map(repr, sorted(record))) or 'no fields'}")
    asked = [record[c] for c in columns[:2] if record.get(c)]
    if not all(isinstance(a, str) for a in asked):
        raise Reject("bad_field", f"{columns[0]!r} and {columns[1]!r} must be text")
    turns.append(_texts_turn("user", "\n".join(asked), f"{columns[0]!r}"))
    if record.get(columns[2]) is not None:
        turns.append(_texts_turn("assistant", record[columns[2]], repr(columns[2])))
    return turns


def text_turn(role: str, text: str, where: str = "turn") -> Turn:
    """A turn of text whose ``<image>`` and ``<video>`` placeholders become items."""
    _check_text(text, where)
    chunks = _PLACEHOLDERS.split(text)
    if len(chunks) == 1:
        return Turn(role, (text,) if text else (), typed=False)
    content: list[str | ImageItem] = []
    for k, chunk in enumerate(chunks):
        if k % 2:
            content.append((VideoItem if chunk == VIDEO_PLACEHOLDER else ImageItem)(True))
        elif chunk:
            content.append(chunk)
    return Turn(role, tuple(content), typed=True)


def _is_pair(message, fmt: RowFormat) -> bool:
    """Whether a turn-list element is a ``texts`` pair rather than one message."""
    return (isinstance(message, dict) and ("user" in message or "assistant" in message)
            and not any(k in message for k in fmt.role_keys))


def _parse_pair(message, i: int) -> list[tuple[Turn, list[ImageRef | None]]]:
    if not isinstance(message, dict) or not ("user" in message or "assistant" in message):
        raise Reject("missing_field", f"turn pair {i} lacks 'user' and 'assistant'")
    return [_texts_turn(role, message[role], f"turn pair {i} {role}") for role in PAIR_ROLES
            if message.get(role) is not None]


def _parse_turn(message, i: int, fmt: RowFormat) -> tuple[Turn, list[ImageRef | None]]:
    if not isinstance(message, dict):
        raise Reject("bad_field", f"turn {i} is a {type(message).__name__}, not an object")
    role_key = next((k for k in fmt.role_keys if message.get(k) is not None), None)
    # A key with a value first: a table that merged rows of both formats holds nulls for the
    # other format's keys.
    content_key = next((k for k in fmt.content_keys if message.get(k) is not None),
                       next((k for k in fmt.content_keys if k in message), None))
    if role_key is None or content_key is None:
        raise Reject("missing_field", f"turn {i} lacks {_names(fmt.role_keys)} or "
                                      f"{_names(fmt.content_keys)}")
    role = fmt.role(message[role_key])
    if role is None:
        known = sorted({*ROLES, *dict(fmt.roles)})
        raise Reject("bad_role", f"turn {i} {role_key} is {message[role_key]!r}; expected one "
                                 f"of {', '.join(known)}")
    content = message[content_key]
    if role == "function_call":
        return Turn("assistant", (), False, _calls_of(content, f"turn {i}")), []
    calls = message.get("tool_calls") if role == "assistant" else None
    if calls:
        turn, refs = _parse_content(role, content, content_key, i)
        return replace(turn, tool_calls=_openai_calls(calls, f"turn {i}")), refs
    return _parse_content(role, content, content_key, i)


def _parse_content(role: str, content, content_key: str, i: int
                   ) -> tuple[Turn, list[ImageRef | None]]:
    if content is None and role == "assistant":  # OpenAI's content of a turn of tool calls
        content = ""
    if isinstance(content, str):
        return _texts_turn(role, content, f"turn {i}")
    if not isinstance(content, list):
        raise Reject("bad_field", f"turn {i} {content_key!r} is a {type(content).__name__}, "
                                  "not text or a list of typed items")
    parts: list[str | ImageItem] = []
    refs: list[ImageRef | None] = []
    for j, item in enumerate(content):
        where = f"turn {i} item {j}"
        kind = item.get("type") if isinstance(item, dict) else None
        if kind == "text":
            text = item.get("text")
            if not isinstance(text, str):
                raise Reject("bad_field", f"{where}: a text item without a 'text' string")
            _check_text(text, where)
            parts.append(text)
        elif kind in ("image", "image_url"):
            parts.append(ImageItem(placeholder=False))
            value = _item_value(item, kind, where)
            refs.append(None if value is None else _image_value(value, where))
        elif kind in ("video", "video_url"):
            parts.append(VideoItem(placeholder=False))
            value = _item_value(item, kind, where)
            refs.append(None if value is None else _video_value(value, where, item.get("fps")))
        elif kind in ("audio", "audio_url", "input_audio"):
            raise _no_audio(f"{where}, of type {kind!r}")
        else:
            what = f"type {kind!r}" if kind is not None else "no 'type'"
            raise Reject("bad_field", f"{where} has {what}; the types read are text, image, "
                                      "image_url, video and video_url")
    return Turn(role, tuple(parts), typed=True), refs


def _calls_of(content, where: str) -> tuple[ToolCall, ...]:
    """A function_call turn's calls: its text is the JSON of ``{"name", "arguments"}`` or a list
    of them, as LLaMA-Factory's ``FunctionFormatter`` reads it."""
    if isinstance(content, str):
        try:
            content = json.loads(content)
        except json.JSONDecodeError as e:
            raise Reject("bad_field", f"{where}: a function_call turn that is not JSON: "
                                      f"{e}") from e
    calls = content if isinstance(content, list) else [content]
    if not calls or not all(isinstance(c, dict) and isinstance(c.get("name"), str)
                            and c["name"] and "arguments" in c for c in calls):
        raise Reject("bad_field", f"{where}: a function_call turn must hold {{\"name\", "
                                  "\"arguments\"} or a list of them")
    for call in calls:
        _check_text(call["name"], f"{where} function name")
    return tuple(ToolCall(c["name"], c["arguments"]) for c in calls)


def _openai_calls(calls, where: str) -> tuple[ToolCall, ...]:
    """An OpenAI assistant message's ``tool_calls``: ``{"type": "function", "function": {"name",
    "arguments"}}`` each."""
    if not isinstance(calls, list):
        raise Reject("bad_field", f"{where}: tool_calls must be a list")
    return _calls_of([c.get("function", c) if isinstance(c, dict) else c for c in calls], where)


def _item_value(item: dict, kind: str, where: str):
    """What an image or video item (``kind``: image, image_url, video, video_url) names itself:
    its ``*_url``'s url, or its ``image``/``video``, ``url`` or ``path``; None where it names
    nothing (it takes the next of its column)."""
    if kind.endswith("_url"):
        value = item.get(kind)
        value = value.get("url") if isinstance(value, dict) else value
        if value is None:
            raise Reject("bad_field", f"{where}: {kind} item without a url")
        return value
    return next((item[k] for k in (kind, "url", "path") if item.get(k) is not None), None)


def _place_images(turns: list[Turn], inline: list, listed: list, all_first: bool,
                  item: type[ImageItem]) -> tuple[list[Turn], list]:
    """Each image (video) item gets its image (video): its own, else the next of the images
    (videos) column. A row with one listed image and no item gets it before its first user
    text (InternVL's rule); with ``all_first`` (turn pairs), every listed image does."""
    wanting = inline.count(None)
    if wanting == len(listed):
        it = iter(listed)
        return turns, [ref if ref is not None else next(it) for ref in inline]
    if not inline and (len(listed) == 1 or all_first):
        k = next(k for k, t in enumerate(turns) if t.role != "system")
        first = turns[k]
        items = (item(False),) * len(listed)
        turns = [*turns[:k], Turn(first.role, (*items, *first.content), True), *turns[k + 1:]]
        return turns, listed
    named = len(inline) - wanting
    what = "video" if item is VideoItem else "image"
    # A placeholder: a <image> (<video>) in text, or an item naming no image of its own.
    raise Reject(f"{what}_count_mismatch",
                 f"{_count(wanting, 'placeholder')}, {_count(len(listed), what)} in the "
                 f"{what}s column" + (f" ({_count(named, 'more ' + what + ' item')} naming "
                                      "its own)" if named else ""))


def _count(n: int, noun: str) -> str:
    """``1 image``, ``2 images``."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _image_values(value, column: str) -> list[ImageRef]:
    values = value if isinstance(value, list) else [value]
    return [_image_value(v, f"{column} {k}") for k, v in enumerate(values)]


def _video_values(value, column: str, fps) -> list[VideoRef]:
    """A videos column: one video, or a list of them (a list of lists: frame lists)."""
    if isinstance(value, list) and value and all(isinstance(v, list) for v in value):
        return [_video_value(v, f"{column} {k}", fps) for k, v in enumerate(value)]
    values = value if isinstance(value, list) else [value]
    return [_video_value(v, f"{column} {k}", fps) for k, v in enumerate(values)]


def _video_value(value, where: str, fps) -> VideoRef:
    """A container file as an image value is (path, URL, ``data:`` URI, ``{bytes, path}``), or a
    list of frame images (at ``fps``, where given)."""
    if fps is not None and (isinstance(fps, bool) or not isinstance(fps, (int, float))
                            or not fps > 0):
        raise Reject("bad_field", f"video {where}: fps {fps!r} is not a positive number")
    if isinstance(value, list):
        if not value:
            raise Reject("empty_video", f"video {where} is an empty list of frames")
        frames = tuple(_image_value(v, f"{where} frame {k}") for k, v in enumerate(value))
        return VideoRef(frames=frames, fps=None if fps is None else float(fps))
    return VideoRef(file=_image_value(value, where, "video"))


def _image_value(value, where: str, what: str = "image") -> ImageRef:
    """A path or URL, a ``data:`` URI, or a ``datasets`` ``Image`` value ``{bytes, path}``."""
    if isinstance(value, dict):
        data, path = value.get("bytes"), value.get("path")
        if isinstance(data, (bytes, bytearray)):
            return ImageRef(path=path if isinstance(path, str) and path else None,
                            data=bytes(data))
        if data is not None:
            raise Reject("bad_field", f"{what} {where}: 'bytes' is a {type(data).__name__}")
        if not isinstance(path, str) or not path:
            raise Reject("bad_field", f"{what} {where} has neither bytes nor a path")
        value = path
    if not isinstance(value, str) or not value:
        raise Reject("bad_field", f"{what} {where} is {type(value).__name__} {value!r:.40}; "
                                  f"expected a path, a URL or a value {{bytes, path}}")
    if value.startswith("data:"):
        header, _, payload = value.partition(",")
        if not header.endswith(";base64"):
            raise Reject("bad_field", f"{what} {where}: a data URI that is not base64")
        try:
            return ImageRef(data=base64.b64decode(payload, validate=True))
        except (binascii.Error, ValueError) as e:
            raise Reject(f"corrupt_{what}", f"{what} {where}: its base64 data does not decode: "
                                            f"{e}") from e
    if "\0" in value:
        raise Reject("nul_in_text", f"{what} {where} path {value!r} holds a NUL character")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise Reject("undecodable_text", f"{what} {where} path {value!r} is not valid UTF-8: "
                                         f"{e}") from e
    return ImageRef(path=value)


def _check_text(text: str, where: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise Reject("undecodable_text", f"{where} has text that is not valid UTF-8: {e}") from e
    if "\0" in text:
        raise Reject("nul_in_text", f"{where} holds a NUL character at position "
                                    f"{text.index(chr(0))}: binary or UTF-16 data read as text")


def _names(names) -> str:
    """'a', 'b' or 'c'."""
    quoted = [repr(n) for n in names]
    return " or ".join([", ".join(quoted[:-1]), quoted[-1]] if len(quoted) > 2 else quoted)


def missing_columns(record: dict, fmt: RowFormat, columnar: bool) -> list[str]:
    """The renamed columns and turn keys (``fmt.columns``) that ``record`` lacks, as
    ``key=name``: the turn keys are looked for in its first turn. The columns a row may leave
    out (images, system, tools, ...) only where every row has every column (``columnar``: Parquet,
    Arrow)."""
    renamed = dict(fmt.columns)
    keys = ("messages", "prompt", "response") + columnar * ("images", "videos", "system", "tools",
                                                            "query", "history")
    missing = [f"{key}={renamed[key]}" for key in keys
               if key in renamed and renamed[key] not in record]
    turns = next((record[c] for c in fmt.turn_columns if isinstance(record.get(c), list)), None)
    if turns and isinstance(turns[0], dict):
        missing += [f"{key}={renamed[key]}" for key in ("role", "content")
                    if key in renamed and renamed[key] not in turns[0]]
    return missing


def format_hint(record: dict, fmt: RowFormat) -> str | None:
    """What a row that every check rejected looks like, and the option that reads it, when its
    fields tell (a format or a column name), else None."""
    if fmt.name == "alpaca":
        return None
    for name, (columns, roles, contents) in FORMATS.items():
        if name != "auto" and name != fmt.name and any(c in record for c in columns) \
                and not any(c in record for c in fmt.turn_columns):
            return (f"rows have {_names(columns)}, not {_names(fmt.turn_columns)}: this looks "
                    f"like the {name} format; pass --format {name} (or --format auto)")
    present = [c for c in fmt.turn_columns if isinstance(record.get(c), list)]
    if not present:
        lists = [k for k, v in sorted(record.items())
                 if isinstance(v, list) and v and all(isinstance(t, dict) for t in v)]
        guess = f"; name yours with --columns messages={lists[0]}" if lists else ""
        fields = ", ".join(map(repr, sorted(record))) or "no fields"
        return f"rows have {fields}, none of them {_names(fmt.turn_columns)}{guess}"
    first = record[present[0]][0] if record[present[0]] else None
    if isinstance(first, dict) and not (any(k in first for k in fmt.role_keys)
                                        and any(k in first for k in fmt.content_keys)):
        keys = ", ".join(map(repr, sorted(first)))
        return (f"turns have {keys}, not {_names(fmt.role_keys)} and "
                f"{_names(fmt.content_keys)}: name them with --columns role=... content=...")
    return _role_hint(record[present[0]], fmt)


def _role_hint(turns: list, fmt: RowFormat) -> str | None:
    """``--roles NAME=ROLE`` for the first role that no mapping names, ROLE guessed from its
    place: after any system turn, a conversation alternates user and assistant."""
    said = [next((t[k] for k in fmt.role_keys if t.get(k) is not None), None)
            for t in turns if isinstance(t, dict)]
    said = [r for r in said if isinstance(r, str) and fmt.role(r) != "system"]
    i, name = next(((i, r) for i, r in enumerate(said) if fmt.role(r) is None), (0, None))
    if name is None:
        return None
    return (f"turns have role {name!r}, which is not user, assistant or system: map it with "
            f"--roles {name}={('user', 'assistant')[i % 2]}")
