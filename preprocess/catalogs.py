"""Meta files: JSON objects naming other inputs, one source per entry (in key order, or in the
order ``--datasets`` names them).

- InternVL's meta file: ``{name: {"annotation": file, "root": dir, "repeat_time": r,
  "max_dynamic_patch": n}}``, plus vlmshard's own ``format``, ``columns``, ``roles`` and
  ``split`` per entry;
- LLaMA-Factory's ``dataset_info.json``: ``{name: {"file_name": file, "formatting":
  "sharegpt"|"alpaca", "columns": {...}, "tags": {...}, "split": s}}``, read as LLaMA-Factory's
  ``data/parser.py`` and ``data/converter.py`` read it (defaults included: ``formatting``
  alpaca, ``split`` train, sharegpt's ``conversations`` of ``from``/``value`` with ``human``,
  ``gpt``, ``system``, ``observation`` and ``function_call`` tags; alpaca's ``instruction``,
  ``input``, ``output``). Images are found from the file's folder (LLaMA-Factory's
  ``media_dir`` default) or ``--image-root``. Audio columns are read, and their rows rejected
  (``unsupported_audio``): no family here hears.

``--datasets`` picks entries by name, as LLaMA-Factory's ``dataset: a,b`` does; only those are
read and judged. Without it every entry is read, and a file holding entries that cannot be read
(hub entries, ranking and KTO data) is refused whole, listing them: LLaMA-Factory never reads a
``dataset_info.json`` whole, so such a file without ``--datasets`` is a selection forgotten, and
reading the rest would drop what the user meant in silence.
"""

from __future__ import annotations

import json
import logging
import os

from vlmshard.errors import ConfigError, InputError
from vlmshard.io import file_exists, is_url, open_file, resolve

from .containers import Container, Input, SourceOptions
from .conversation import RowFormat

log = logging.getLogger(__name__)


def json_object(path: str) -> dict | None:
    """The parsed file if ``path`` holds a JSON object, else None (a list is never read whole
    here: only its first bytes)."""
    if not path.endswith(".json"):
        return None
    with open_file(path) as f:
        head = f.read(4096).lstrip()
    if not head.startswith(b"{"):
        return None
    with open_file(path) as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as e:
            raise InputError(f"{path} is neither a conversation list nor a valid meta file: "
                             f"{e}") from e


def _entries_with(meta: dict | None, keys: tuple[str, ...]) -> bool:
    return meta is not None and any(isinstance(v, dict) and any(k in v for k in keys)
                                    for v in meta.values())


def selected(meta: dict, options: SourceOptions) -> list[tuple[str, object]]:
    """The entries ``--datasets`` names that this file holds, in the order named; every entry,
    in key order, without it. A name in none of the inputs is ``discover_sources``' error."""
    if options.datasets is None:
        return list(meta.items())
    return [(name, meta[name]) for name in options.datasets if name in meta]


class InternVLMeta(Container):
    kind = "internvl_meta"
    description = 'an InternVL meta .json ({name: {"annotation": file, "root": dir}})'

    def claims(self, path: str) -> bool:
        return _entries_with(json_object(path), ("annotation",))

    def sources(self, path: str, options: SourceOptions) -> list[Input]:
        entries = selected(json_object(path), options)
        bad = [k for k, v in entries if not isinstance(v, dict) or "annotation" not in v]
        if bad:
            raise InputError(f"InternVL meta file {path}: entries {bad[:3]} lack an 'annotation' "
                             'path (expected {name: {"root": dir, "annotation": file, '
                             '"repeat_time": 1}})')
        base = os.path.dirname(path)
        sources = []
        for name, entry in entries:
            annotation = resolve(base, entry["annotation"])
            if not file_exists(annotation):
                raise InputError(f"meta file {path}: annotation of {name!r} not found: "
                                 f"{annotation}")
            repeat = float(entry.get("repeat_time", 1.0))
            if repeat <= 0:
                raise InputError(f"meta file {path}: repeat_time of {name!r} must be > 0")
            max_num = entry.get("max_dynamic_patch")
            try:
                row_format = RowFormat.from_options(entry.get("format", "auto"),
                                                    entry.get("columns"), entry.get("roles"))
            except ConfigError as e:
                raise InputError(f"meta file {path}: entry {name!r}: {e}") from e
            sources.append(Input(annotation, SourceOptions(
                name=name, image_root=resolve(base, entry.get("root",
                                                              os.path.dirname(annotation))),
                format=row_format, split=entry.get("split"), repeat_time=repeat,
                max_num=int(max_num) if max_num is not None else None)))
        return sources


# LLaMA-Factory's defaults (data/parser.py's DatasetAttr) and the keys vlmshard reads.
_HUB_KEYS = ("hf_hub_url", "ms_hub_url", "om_hub_url", "script_url", "cloud_file_name")
_SHAREGPT_TAGS = {"role_tag": "from", "content_tag": "value", "user_tag": "human",
                  "assistant_tag": "gpt", "system_tag": "system",
                  "observation_tag": "observation", "function_tag": "function_call"}
_MEDIA = ("images", "videos", "audios")
_COLUMNS = {"sharegpt": ("messages", *_MEDIA, "system", "tools"),
            "alpaca": ("prompt", "query", "response", "history", *_MEDIA, "system", "tools")}
_PREFERENCE = ("chosen", "rejected", "kto_tag")  # ranking and KTO columns


class LlamaFactoryInfo(Container):
    kind = "llamafactory"
    description = ("LLaMA-Factory's dataset_info.json "
                   '({name: {"file_name": file, "formatting": "sharegpt"}})')

    def claims(self, path: str) -> bool:
        meta = json_object(path)
        return meta is not None and (os.path.basename(path) == "dataset_info.json"
                                     or _entries_with(meta, ("file_name", *_HUB_KEYS)))

    def sources(self, path: str, options: SourceOptions) -> list[Input]:
        base = os.path.dirname(path)
        entries = selected(json_object(path), options)
        unread = {name: why for name, entry in entries
                  if (why := _unread(entry, base)) is not None}
        if options.datasets is not None and unread:
            name, (_, why) = next(iter(unread.items()))
            raise InputError(f"LLaMA-Factory file {path}: entry {name!r} {why}")
        if unread:
            kinds: dict[str, list[str]] = {}
            for name, (kind, _) in unread.items():
                kinds.setdefault(kind, []).append(name)
            listed = "; ".join(f"{len(names)} {kind} ({_few(names)})"
                               for kind, names in kinds.items())
            readable = [n for n, _ in entries if n not in unread]
            raise InputError(
                f"LLaMA-Factory file {path}: {len(unread)} of {len(entries)} entries cannot be "
                f"read: {listed}. Name the entries to read with --datasets, as LLaMA-Factory's "
                "dataset: does" + (f"; readable: {_few(readable)}" if readable else ""))
        sources = []
        for name, entry in entries:
            where = f"LLaMA-Factory file {path}: entry {name!r}"
            if entry.get("num_samples") is not None:
                log.warning("%s: num_samples is not read; every row is taken", where)
            root = options.image_root or base
            sources.append(Input(resolve(base, entry["file_name"]), SourceOptions(
                name=name, image_root=root if is_url(root) else os.path.abspath(root),
                format=_row_format(entry), split=entry.get("split", "train"))))
        return sources


def _few(names: list[str], n: int = 4) -> str:
    return ", ".join(names[:n]) + (", ..." if len(names) > n else "")


def _unread(entry, base: str) -> tuple[str, str] | None:
    """(what kind of entry, why) vlmshard cannot read it, or None: it reads instruction data in
    a local file, in the formattings and columns it knows."""
    if not isinstance(entry, dict):
        return "not objects", f"is a {type(entry).__name__}, not an object"
    if "file_name" not in entry:
        hub = [k for k in _HUB_KEYS if k in entry]
        return "on a hub", "has no file_name" + (
            f" (it is loaded from {hub[0]}; vlmshard reads local files: download it and name "
            "it in file_name)" if hub else "")
    if entry.get("ranking") or any(c in (entry.get("columns") or {}) for c in _PREFERENCE):
        return "preference data", ("is preference data (ranking or KTO); vlmshard reads "
                                   "instruction data")
    formatting = entry.get("formatting", "alpaca")
    if formatting not in _COLUMNS:
        return "in other formattings", (f"has formatting {formatting!r}; vlmshard reads "
                                        f"{' and '.join(_COLUMNS)}")
    unread = sorted(set(entry.get("columns") or {}) - set(_COLUMNS[formatting]))
    if unread:
        return "with other columns", (f"has columns {', '.join(unread)}, not read for "
                                      f"{formatting}; vlmshard reads "
                                      f"{', '.join(_COLUMNS[formatting])}")
    if not file_exists(resolve(base, entry["file_name"])):
        return "with no file", (f"has a file_name that is not found: "
                                f"{resolve(base, entry['file_name'])}")
    return None


def _row_format(entry: dict) -> RowFormat:
    """The entry's ``formatting``, ``columns`` and ``tags`` as a ``RowFormat``."""
    columns = dict(entry.get("columns") or {})
    if entry.get("formatting", "alpaca") == "alpaca":
        return RowFormat.from_options("alpaca", columns)
    tags = {**_SHAREGPT_TAGS, **(entry.get("tags") or {})}
    columns.setdefault("messages", "conversations")
    columns.update(role=tags["role_tag"], content=tags["content_tag"])
    roles = {tags["user_tag"]: "user", tags["assistant_tag"]: "assistant",
             tags["system_tag"]: "system", tags["observation_tag"]: "tool",
             tags["function_tag"]: "function_call"}
    return RowFormat.from_options("llava", columns, roles)
