"""Options of ``vlmshard demo-data`` and the ``demo_model`` section of ``vlmshard run``."""

from __future__ import annotations

from dataclasses import dataclass

from vlmshard.config import ConfigError, option
from vlmshard.families import model_types


@dataclass(kw_only=True)
class DemoDataConfig:
    """Options of ``vlmshard demo-data`` (and the ``demo_data`` section of ``vlmshard run``)."""

    out: str = option(help="folder to write the dataset into")
    seed: int = option(0, help="seed of the generated conversations and bad rows")
    scale: int = option(1, help="multiply the number of samples")


@dataclass(kw_only=True)
class DemoModelConfig:
    """The ``demo_model`` option of ``vlmshard run``: which tiny model folder to make, where."""

    model_type: str = option(help="the tiny model's config.json model_type")
    out: str = option(help="model folder to write")

    def __post_init__(self) -> None:
        if self.model_type not in model_types():
            raise ConfigError(f"demo_model {self.model_type!r}: known model types are "
                              f"{', '.join(model_types())}")
