"""The container kinds by name: the one place an input path finds what reads it.

Built in (``vlmshard.preprocess.readers``, ``catalogs``): JSONL, JSON lists, Parquet, Arrow,
``save_to_disk`` folders, ``DatasetDict`` folders, InternVL meta files and LLaMA-Factory's
``dataset_info.json``. More come from the modules that the environment variable
``VLMSHARD_READERS`` names (comma-separated, importable), each calling ``register`` when
imported, as families do. A registered container is asked before the built-in ones, so it may
claim paths they would.
"""

from __future__ import annotations

from vlmshard.errors import InputError
from vlmshard.plugins import Registry

from .catalogs import InternVLMeta, LlamaFactoryInfo
from .containers import Container, Input, RowReader, Source, SourceOptions
from .readers import Arrow, DatasetDict, JsonList, Jsonl, Parquet, SavedDataset

PLUGINS_VARIABLE = "VLMSHARD_READERS"


def _built_ins() -> None:
    # Asked in this order: a meta file before a JSON list, a DatasetDict before a saved dataset.
    for container in (InternVLMeta(), LlamaFactoryInfo(), Jsonl(), JsonList(), Parquet(),
                      Arrow(), DatasetDict(), SavedDataset()):
        register(container, built_in=True)


_KINDS: Registry[Container] = Registry("container kind", PLUGINS_VARIABLE, _built_ins)


def register(container: Container, *, replace: bool = False, built_in: bool = False
             ) -> Container:
    """Add ``container`` (an instance) under its ``kind``; a kind registered already is an error
    unless ``replace``."""
    return _KINDS.add(container.kind, container, replace=replace, built_in=built_in)


def containers() -> list[Container]:
    """Every registered container, in the order they are asked: the user's, then built-in."""
    return sorted(_KINDS.all().values(), key=lambda c: c.kind in _KINDS.built_in)


def reader(kind: str) -> RowReader:
    """The row reader of ``kind`` (as sources record it)."""
    found = _KINDS.all().get(kind)
    if not isinstance(found, RowReader):
        known = sorted(k for k, c in _KINDS.items.items() if isinstance(c, RowReader))
        raise InputError(f"no row reader of kind {kind!r}; known: {', '.join(known)} (a reader "
                         f"of your own: name its module in {PLUGINS_VARIABLE})")
    return found


def sources_of(path: str, options: SourceOptions) -> list[Source]:
    """The sources the input ``path`` holds, by the first container that claims it (and the
    inputs it names, each by theirs)."""
    container = next((c for c in containers() if c.claims(path)), None)
    if container is None:
        kinds = "; ".join(c.description for c in containers())
        raise InputError(f"cannot tell the format of {path}: use {kinds}")
    return [found for item in container.sources(path, options)
            for found in (sources_of(item.path, item.options) if isinstance(item, Input)
                          else [item])]
