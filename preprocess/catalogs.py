"""Meta files: JSON objects naming other inputs, one source per entry (in key order).

- InternVL's meta file: ``{name: {"annotation": file, "root": dir, "repeat_time": r,
  "max_dynamic_patch": n}}``, plus vlmshard's own ``format``, ``columns``, ``roles`` and
  ``split`` per entry;
- LLaMA-Factory's ``dataset_info.json``: ``{name: {"file_name": file, "formatting":
  "sharegpt"|"alpaca", "columns": {...}, "tags": {...}, "split": s}}``, read as LLaMA-Factory's
  ``data/parser.py`` and ``data/converter.py`` read it (defaults included: ``formatting``
  alpaca, ``split`` train, sharegpt's ``conversations`` of ``from``/``value`` with ``human``,
  ``gpt`` and ``system`` tags; alpaca's ``instruction``, ``input``, ``output``). Images are
  found from the file's folder (LLaMA-Factory's ``media_dir`` default) or ``--image-root``.
  Not read (refused, naming them): hub entries (``hf_hub_url``, ...), ranking and KTO data,
  audio; turns tagged ``observation_tag`` or ``function_tag`` (tool calls and results) are
  ``bad_role`` rejects.
"""

from __future__ import annotations

import json
import logging
import os

from vlmshard.errors import InputError
from vlmshard.io import file_exists, is_url, open_file, resolve

from .containers import Container, Source, SourceOptions, sources_of
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


class InternVLMeta(Container):
    kind = "internvl_meta"
    description = 'an InternVL meta .json ({name: {"annotation": file, "root": dir}})'

    def claims(self, path: str) -> bool:
        return _entries_with(json_object(path), ("annotation",))

    def sources(self, path: str, options: SourceOptions) -> list[Source]:
        meta = json_object(path)
        bad = [k for k, v in meta.items() if not isinstance(v, dict) or "annotation" not in v]
        if bad:
            raise InputError(f"InternVL meta file {path}: entries {bad[:3]} lack an 'annotation' "
                             'path (expected {name: {"root": dir, "annotation": file, '
                             '"repeat_time": 1}})')
        base = os.path.dirname(path)
        sources = []
        for name, entry in meta.items():
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
            except ValueError as e:
                raise InputError(f"meta file {path}: entry {name!r}: {e}") from e
            sources += sources_of(annotation, SourceOptions(
                name=name, image_root=resolve(base, entry.get("root",
                                                              os.path.dirname(annotation))),
                format=row_format, split=entry.get("split"), repeat_time=repeat,
                max_num=int(max_num) if max_num is not None else None))
        return sources


# LLaMA-Factory's defaults (data/parser.py's DatasetAttr) and the keys vlmshard reads.
_HUB_KEYS = ("hf_hub_url", "ms_hub_url", "om_hub_url", "script_url", "cloud_file_name")
_SHAREGPT_TAGS = {"role_tag": "from", "content_tag": "value", "user_tag": "human",
                  "assistant_tag": "gpt", "system_tag": "system"}
_COLUMNS = {"sharegpt": ("messages", "images", "videos", "system", "tools"),
            "alpaca": ("prompt", "query", "response", "history", "images", "videos", "system",
                       "tools")}


class LlamaFactoryInfo(Container):
    kind = "llamafactory"
    description = ("LLaMA-Factory's dataset_info.json "
                   '({name: {"file_name": file, "formatting": "sharegpt"}})')

    def claims(self, path: str) -> bool:
        meta = json_object(path)
        return meta is not None and (os.path.basename(path) == "dataset_info.json"
                                     or _entries_with(meta, ("file_name", *_HUB_KEYS)))

    def sources(self, path: str, options: SourceOptions) -> list[Source]:
        base = os.path.dirname(path)
        sources = []
        for name, entry in json_object(path).items():
            where = f"LLaMA-Factory file {path}: entry {name!r}"
            if not isinstance(entry, dict) or "file_name" not in entry:
                hub = [k for k in _HUB_KEYS if isinstance(entry, dict) and k in entry]
                raise InputError(f"{where} has no file_name" + (
                    f" (it is loaded from {hub[0]}; vlmshard reads local files: download it "
                    "and name it in file_name)" if hub else ""))
            if entry.get("ranking"):
                raise InputError(f"{where} is a ranking (preference pair) dataset; vlmshard "
                                 "reads instruction data")
            if entry.get("num_samples") is not None:
                log.warning("%s: num_samples is not read; every row is taken", where)
            file_name = resolve(base, entry["file_name"])
            if not file_exists(file_name):
                raise InputError(f"{where}: file_name not found: {file_name}")
            root = options.image_root or base
            sources += sources_of(file_name, SourceOptions(
                name=name, image_root=root if is_url(root) else os.path.abspath(root),
                format=_row_format(entry, where), split=entry.get("split", "train")))
        return sources


def _row_format(entry: dict, where: str) -> RowFormat:
    """The entry's ``formatting``, ``columns`` and ``tags`` as a ``RowFormat``."""
    formatting = entry.get("formatting", "alpaca")
    if formatting not in _COLUMNS:
        raise InputError(f"{where}: formatting {formatting!r}; vlmshard reads "
                         f"{' and '.join(_COLUMNS)}")
    columns = dict(entry.get("columns") or {})
    unread = sorted(set(columns) - set(_COLUMNS[formatting]))
    if unread:
        raise InputError(f"{where}: columns {', '.join(unread)} are not read for "
                         f"{formatting}; vlmshard reads {', '.join(_COLUMNS[formatting])}")
    if formatting == "alpaca":
        return RowFormat.from_options("alpaca", columns)
    tags = {**_SHAREGPT_TAGS, **(entry.get("tags") or {})}
    columns.setdefault("messages", "conversations")
    columns.update(role=tags["role_tag"], content=tags["content_tag"])
    roles = {tags["user_tag"]: "user", tags["assistant_tag"]: "assistant",
             tags["system_tag"]: "system"}
    return RowFormat.from_options("llava", columns, roles)
