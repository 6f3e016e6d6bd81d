"""The model families by name: the one place the stages ask about a model.

Built in: ``internvl``, ``qwen2vl``, ``qwen3vl``, ``qwen3_5`` and ``gemma3``. More come from the
modules that the environment variable ``VLMSHARD_FAMILIES`` names (comma-separated, importable),
each calling ``register`` when imported: a family defined outside this package then goes through
every stage, in every process a job starts (they inherit the environment). A registered family
takes over the ``model_type`` values it lists from a built-in one.
"""

from __future__ import annotations

import logging
import os
from dataclasses import fields, replace

from vlmshard.errors import ConfigError, InputError
from vlmshard.io import sha256_file
from vlmshard.model_sizes import ModelConfig
from vlmshard.plugins import Registry

from .base import Family, ModelSpec, TilingPolicy
from .folder import ModelFolderError, read_model_folder

log = logging.getLogger(__name__)

PLUGINS_VARIABLE = "VLMSHARD_FAMILIES"
DEMO_FAMILY = "internvl"  # whose image processing the demo tokenizer (no model folder) counts with



def _built_ins() -> None:
    from .gemma3 import Gemma3
    from .internvl import InternVL
    from .qwen2vl import Qwen2VL
    from .qwen3_5 import Qwen3_5
    from .qwen3vl import Qwen3VL

    for family in (InternVL(), Qwen2VL(), Qwen3VL(), Qwen3_5(), Gemma3()):
        register(family, built_in=True)


_FAMILIES: Registry[Family] = Registry("model family", PLUGINS_VARIABLE, _built_ins)
_BY_MODEL_TYPE: dict[str, str] = {}


def register(family: Family, *, replace: bool = False, built_in: bool = False) -> Family:
    """Add ``family`` (an instance) under its name; it serves its ``model_types`` unless it is
    built in and another registered family serves one of them already. A name registered
    already is refused unless ``replace``: then ``family`` takes its place."""
    if family.default_preset not in family.presets:
        raise ConfigError(f"model family {family.name}: its default_preset "
                          f"{family.default_preset!r} is none of its presets "
                          f"({', '.join(family.presets) or 'none'})")
    _FAMILIES.add(family.name, family, replace=replace, built_in=built_in)
    for model_type in [t for t, name in _BY_MODEL_TYPE.items() if name == family.name]:
        del _BY_MODEL_TYPE[model_type]  # a replaced family's
    for model_type in family.model_types:
        holder = _BY_MODEL_TYPE.get(model_type)
        if built_in and holder is not None and holder not in _FAMILIES.built_in:
            continue
        if holder is not None and holder != family.name:
            log.info("model_type %r: family %s takes over from %s", model_type, family.name,
                     holder)
        _BY_MODEL_TYPE[model_type] = family.name
    return family


def families() -> dict[str, Family]:
    """Every registered family by name."""
    return dict(_FAMILIES.all())


def family(name: str) -> Family:
    """The family ``name`` (as stats, plans and shards record it)."""
    found = _FAMILIES.all()
    if name not in found:
        raise InputError(f"unknown model family {name!r}; known: {', '.join(sorted(found))} "
                         f"(a family of your own: name its module in {PLUGINS_VARIABLE})")
    return found[name]


def presets() -> dict[str, ModelConfig]:
    """Every registered family's named model sizes (``Family.presets``), and ``tiny``: the
    sizes' defaults, every code path in seconds on a CPU."""
    found = {"tiny": ModelConfig()}
    for fam in _FAMILIES.all().values():
        for name, sizes in fam.presets.items():
            if found.setdefault(name, sizes) != sizes:
                raise ConfigError(f"model preset {name!r} of family {fam.name} is another "
                                  "family's preset name with other sizes: rename one")
    return found


def model_types() -> list[str]:
    """Every ``model_type`` a registered family serves."""
    _FAMILIES.load()
    return sorted(_BY_MODEL_TYPE)


def family_for_model_type(model_type: str, path: str) -> Family:
    """The family serving ``model_type``; ``path`` (the folder) names the error."""
    _FAMILIES.load()
    if model_type not in _BY_MODEL_TYPE:
        raise ModelFolderError(f"{os.path.join(path, 'config.json')}: model_type {model_type!r} "
                               f"is not a supported family (supported: "
                               f"{', '.join(model_types())})")
    return _FAMILIES.items[_BY_MODEL_TYPE[model_type]]


def load_model(path: str) -> tuple[ModelSpec, TilingPolicy]:
    """The family, image layout and tiling policy a model folder defines."""
    folder = read_model_folder(path)
    model_type = folder.config.get("model_type", "")
    fam = family_for_model_type(model_type, path)
    names = [n for n in sorted(os.listdir(folder.path))
             if n.endswith((".json", ".jinja")) and not n.endswith(".index.json")]
    dtype = folder.config.get("dtype") or folder.config.get("torch_dtype") or "float32"
    spec = ModelSpec(family=fam.name, path=folder.path, model_type=model_type,
                     layout=fam.layout(folder), video_layout=fam.video_layout(folder),
                     dtype=str(dtype),
                     files={n: sha256_file(os.path.join(folder.path, n)) for n in names})
    return spec, fam.tiling(folder)


def model_sizes(config: dict, folder: str) -> ModelConfig:
    """The ``vlmshard.model_sizes.ModelConfig`` a ``config.json`` states (of the model folder
    ``folder``, which names it), in the ViT unit its family's stats count."""
    fam = family_for_model_type(config.get("model_type", ""), folder)
    sizes = fam.model_sizes(config, os.path.basename(os.path.abspath(folder)))
    return replace(sizes, llm=replace(sizes.llm, tied_embeddings=ties_embeddings(config)))


def ties_embeddings(config: dict) -> bool:
    """Whether ``transformers`` ties the LM head to the token embedding of a ``config.json``: as
    its config class reads the file (the class's default where the file leaves it out, older
    Qwen2.5-VL files' ``text_config`` value); for a ``model_type`` it does not know, the
    file's ``tie_word_embeddings``."""
    from transformers import CONFIG_MAPPING

    model_type = config.get("model_type", "")
    if model_type not in CONFIG_MAPPING:
        return bool(config.get("tie_word_embeddings", False))
    return bool(CONFIG_MAPPING[model_type].from_dict(config).tie_word_embeddings)


def policy_from_dict(d: dict) -> TilingPolicy:
    """Inverse of ``policy.to_dict()``, for stages that read the recorded policy."""
    _FAMILIES.load()
    d = dict(d)
    kind = d.pop("name")
    classes = {cls.name: cls for fam in _FAMILIES.items.values() for cls in fam.policies}
    if kind not in classes:
        raise InputError(f"tiling policy {kind!r} is none of the registered families' "
                         f"({', '.join(sorted(classes))})")
    cls = classes[kind]
    names = {f.name for f in fields(cls)}
    return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items() if k in names})


def source_tiling(base: TilingPolicy, max_patches: int | None) -> TilingPolicy:
    """The policy for one source: an InternVL-style meta file's ``max_dynamic_patch`` overrides
    the model's tile limit, where the family has one (other families ignore it)."""
    if max_patches is None:
        return base
    return base.with_limits(max_patches=max_patches) or base


def tiny_folder(model_type: str, path: str, **sizes) -> str:
    """A tiny offline model folder of ``model_type`` (random weights) at ``path``."""
    _FAMILIES.load()
    if model_type not in _BY_MODEL_TYPE:
        raise ConfigError(f"no tiny model of model_type {model_type!r}; known: "
                          f"{', '.join(model_types())}")
    return _FAMILIES.items[_BY_MODEL_TYPE[model_type]].tiny_folder(path, model_type, **sizes)

