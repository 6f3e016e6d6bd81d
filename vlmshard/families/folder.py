"""A local Hugging Face model folder, parsed once: the files a family reads its rules from.

``--model PATH`` names a folder holding ``config.json``, ``tokenizer.json``,
``tokenizer_config.json`` (its ``chat_template``, or a ``chat_template.jinja`` beside it) and
``preprocessor_config.json`` (or ``processor_config.json``). Nothing is downloaded.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from vlmshard.errors import InputError
from vlmshard.io import read_json

REQUIRED_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json")
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")
VIDEO_PROCESSOR_FILE = "video_preprocessor_config.json"


class ModelFolderError(InputError):
    """A model folder that cannot be used; the message is one line naming the file."""


@dataclass(frozen=True)
class ModelFolder:
    """The parsed files of a model folder (read once, by ``read_model_folder``)."""

    path: str
    config: dict
    tokenizer_config: dict
    image_processor: dict  # preprocessor_config.json, or processor_config.json's image_processor
    processor: dict  # processor_config.json (image_seq_length, ...), or {}
    # processor_config.json's video_processor, or video_preprocessor_config.json, or {}
    video_processor: dict = field(default_factory=dict)

    def special_tokens(self) -> dict[str, str]:
        """Named tokens of tokenizer_config.json (``image_token``, ``start_image_token``, ...):
        top-level keys, as ``transformers`` 5 saves them, or ``extra_special_tokens``."""
        extra = self.tokenizer_config.get("extra_special_tokens")
        named = dict(extra) if isinstance(extra, dict) else {}
        named.update({k: v for k, v in self.tokenizer_config.items()
                      if k.endswith("_token") and isinstance(v, str)})
        return named


def _read_json(path: str) -> dict:
    try:
        data = read_json(path)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelFolderError(f"{path}: not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ModelFolderError(f"{path}: expected a JSON object")
    return data


def read_model_folder(path: str) -> ModelFolder:
    """Parse a model folder; a missing or unreadable file is a one-line ``ModelFolderError``."""
    if not os.path.isdir(path):
        raise ModelFolderError(f"--model {path}: no such folder (a local Hugging Face model "
                               "folder; nothing is downloaded)")
    for name in REQUIRED_FILES:
        if not os.path.isfile(os.path.join(path, name)):
            raise ModelFolderError(f"{os.path.join(path, name)}: missing (a model folder needs "
                                   f"{', '.join(REQUIRED_FILES)} and "
                                   f"{' or '.join(PROCESSOR_FILES)})")
    present = [n for n in PROCESSOR_FILES if os.path.isfile(os.path.join(path, n))]
    if not present:
        raise ModelFolderError(f"{os.path.join(path, PROCESSOR_FILES[0])}: missing (nor is there "
                               f"a {PROCESSOR_FILES[1]}): the image processor's limits come "
                               "from it")
    processor = (_read_json(os.path.join(path, PROCESSOR_FILES[1]))
                 if PROCESSOR_FILES[1] in present else {})
    image_processor = (_read_json(os.path.join(path, PROCESSOR_FILES[0]))
                       if PROCESSOR_FILES[0] in present else processor.get("image_processor"))
    if not isinstance(image_processor, dict):
        raise ModelFolderError(f"{os.path.join(path, PROCESSOR_FILES[1])}: no image_processor "
                               "section")
    video = os.path.join(path, VIDEO_PROCESSOR_FILE)
    video_processor = processor.get("video_processor") or (
        _read_json(video) if os.path.isfile(video) else {})
    return ModelFolder(path=os.path.abspath(path),
                       config=_read_json(os.path.join(path, "config.json")),
                       tokenizer_config=_read_json(os.path.join(path, "tokenizer_config.json")),
                       image_processor=image_processor, processor=processor,
                       video_processor=video_processor)


def with_defaults(config: dict, path: str) -> dict:
    """``config.json`` as ``transformers`` reads it: its config classes' defaults filled in (a
    published file may state only what differs from them, as Gemma 3's does, or leave its
    layer kinds to a pattern, as ``full_attention_interval``). ``path`` names the file in the
    error."""
    from transformers import AutoConfig

    try:
        return AutoConfig.for_model(**config).to_dict()
    except (ValueError, TypeError, KeyError) as e:
        raise ModelFolderError(f"{path}: transformers cannot read this config: {e}") from e


def video_value(folder: ModelFolder, key: str, default):
    """A value of the video processor config, else ``default``. ``transformers`` builds the
    video processor from its own config alone; only a folder that has none gets it from the
    image processor's, so a key is never taken from one config to fill the other."""
    value = (folder.video_processor or folder.image_processor).get(key)
    return default if value is None else value


def processor_value(folder: ModelFolder, key: str, default):
    """A value of the image processor config, else of processor_config.json, else ``default``
    (the default of ``transformers``' own processor class)."""
    for source in (folder.image_processor, folder.processor):
        if source.get(key) is not None:
            return source[key]
    return default
