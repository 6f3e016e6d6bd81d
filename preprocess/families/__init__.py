"""Model families: what a local Hugging Face model folder fixes about the data.

``--model PATH`` names a folder holding ``config.json``, ``tokenizer.json``,
``tokenizer_config.json`` (its ``chat_template``, or a ``chat_template.jinja`` beside it) and
``preprocessor_config.json`` (or ``processor_config.json``). ``config.json``'s ``model_type``
picks the family; the family reads the rest: the tiling rule and its limits, the image-token
layout, and how position ids run. The tokenizer and template are rendered by ``transformers``
(``families.chat``), the same for every family.

Adding a family is one module here: a ``Family`` subclass that says which ``model_type`` values
it serves, builds its ``TilingPolicy`` from the processor config, names its image tokens, and
computes position ids for one sample; then add it to ``_families``.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import asdict, dataclass, field

import numpy as np

from vlmshard.errors import InputError
from vlmshard.io import read_json, sha256_file

from ..tiling import TilingPolicy

REQUIRED_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json")
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")


class ModelFolderError(InputError):
    """A model folder that cannot be used; the message is one line naming the file."""


@dataclass(frozen=True)
class ImageLayout:
    """An image's tokens: the chat template renders ``placeholder`` once per image, and it
    becomes ``prefix`` + ``token`` × (the image's tokens) + ``suffix``."""

    placeholder: str
    token: str
    prefix: tuple[str, ...] = ()
    suffix: tuple[str, ...] = ()


@dataclass(frozen=True)
class ModelFolder:
    """The parsed files of a model folder (read once, by ``read_model_folder``)."""

    path: str
    config: dict
    tokenizer_config: dict
    image_processor: dict  # preprocessor_config.json, or processor_config.json's image_processor
    processor: dict  # processor_config.json (image_seq_length, ...), or {}

    def special_tokens(self) -> dict[str, str]:
        """Named tokens of tokenizer_config.json (``image_token``, ``start_image_token``, ...):
        top-level keys, as ``transformers`` 5 saves them, or ``extra_special_tokens``."""
        extra = self.tokenizer_config.get("extra_special_tokens")
        named = dict(extra) if isinstance(extra, dict) else {}
        named.update({k: v for k, v in self.tokenizer_config.items()
                      if k.endswith("_token") and isinstance(v, str)})
        return named


@dataclass(frozen=True)
class ModelSpec:
    """What preprocessing recorded about the model: the family, its image layout, and the
    folder's files by sha256 (a later stage that re-tokenizes checks they did not change)."""

    family: str
    path: str | None  # None: the offline Tekken demo
    model_type: str = ""
    layout: ImageLayout = field(default_factory=lambda: ImageLayout("[IMG]", "[IMG]"))
    dtype: str = "float32"
    files: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelSpec":
        layout = d["layout"]
        return cls(**{**d, "layout": ImageLayout(
            layout["placeholder"], layout["token"], tuple(layout["prefix"]),
            tuple(layout["suffix"]))})

    def unchanged(self) -> bool:
        """Whether the folder's files are still there with the same sha256."""
        return all(os.path.isfile(p := os.path.join(self.path, name)) and sha256_file(p) == digest
                   for name, digest in self.files.items())


class Family:
    """A model family; subclasses fill in the class attributes and the three methods."""

    name: str
    model_types: tuple[str, ...]

    def tiling(self, folder: ModelFolder) -> TilingPolicy:
        """The tiling policy with the limits of the folder's processor config."""
        raise NotImplementedError

    def layout(self, folder: ModelFolder) -> ImageLayout:
        raise NotImplementedError

    def position_ids(self, input_ids: np.ndarray, image_token_id: int,
                     grids: list[tuple[int, int, int]], policy: TilingPolicy) -> np.ndarray:
        """Position ids of one sample alone, [n] or [3, n]; ``grids`` are its images'
        (t, h, w) ViT patch grids in token order."""
        raise NotImplementedError


@functools.cache
def _families() -> dict[str, Family]:
    """Every family by name (imported here: the family modules import this one)."""
    from .internvl import InternVL
    from .qwen2vl import Qwen2VL

    return {f.name: f for f in (InternVL(), Qwen2VL())}


def family(name: str) -> Family:
    if name not in _families():
        raise ValueError(f"unknown model family {name!r}; known: {', '.join(_families())}")
    return _families()[name]


def family_for_model_type(model_type: str, path: str) -> Family:
    for fam in _families().values():
        if model_type in fam.model_types:
            return fam
    known = sorted(t for fam in _families().values() for t in fam.model_types)
    raise ModelFolderError(f"{os.path.join(path, 'config.json')}: model_type {model_type!r} is "
                           f"not a supported family (supported: {', '.join(known)})")


def _read_json(path: str) -> dict:
    try:
        data = read_json(path)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelFolderError(f"{path}: not valid JSON: {e}") from None
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
                                   f"{', '.join(REQUIRED_FILES)} and {' or '.join(PROCESSOR_FILES)})")
    present = [n for n in PROCESSOR_FILES if os.path.isfile(os.path.join(path, n))]
    if not present:
        raise ModelFolderError(f"{os.path.join(path, PROCESSOR_FILES[0])}: missing (nor is there "
                               f"a {PROCESSOR_FILES[1]}): the image processor's limits come from it")
    processor = (_read_json(os.path.join(path, PROCESSOR_FILES[1]))
                 if PROCESSOR_FILES[1] in present else {})
    image_processor = (_read_json(os.path.join(path, PROCESSOR_FILES[0]))
                       if PROCESSOR_FILES[0] in present else processor.get("image_processor"))
    if not isinstance(image_processor, dict):
        raise ModelFolderError(f"{os.path.join(path, PROCESSOR_FILES[1])}: no image_processor "
                               "section")
    return ModelFolder(path=os.path.abspath(path),
                       config=_read_json(os.path.join(path, "config.json")),
                       tokenizer_config=_read_json(os.path.join(path, "tokenizer_config.json")),
                       image_processor=image_processor, processor=processor)


def load_model(path: str) -> tuple[ModelSpec, TilingPolicy]:
    """The family, image layout and tiling policy a model folder defines."""
    folder = read_model_folder(path)
    model_type = folder.config.get("model_type", "")
    fam = family_for_model_type(model_type, path)
    names = [n for n in sorted(os.listdir(folder.path))
             if n.endswith((".json", ".jinja")) and not n.endswith(".index.json")]
    dtype = folder.config.get("dtype") or folder.config.get("torch_dtype") or "float32"
    spec = ModelSpec(family=fam.name, path=folder.path, model_type=model_type,
                     layout=fam.layout(folder), dtype=str(dtype),
                     files={n: sha256_file(os.path.join(folder.path, n)) for n in names})
    return spec, fam.tiling(folder)


def processor_value(folder: ModelFolder, key: str, default):
    """A value of the image processor config, else of processor_config.json, else ``default``
    (the default of ``transformers``' own processor class)."""
    for source in (folder.image_processor, folder.processor):
        if source.get(key) is not None:
            return source[key]
    return default
