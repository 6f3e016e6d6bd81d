"""Model families: one module per family (``internvl``, ``qwen2vl``) holding everything the stages
need to know about it, and one registry (``registry``) the stages ask. Torch-free.

Adding a family: write a ``Family`` subclass (``base``) in a module of its own (its model types,
tiling, image layout, sizes with the LLM features its config.json does not state, presets), its
trainer layer map under ``vlmshard.train.models``, and register it: in ``registry._load`` for a
built-in family, or from any importable module named in ``VLMSHARD_FAMILIES``. A name registers
once, unless replaced on purpose (``register(..., replace=True)``).
"""

from .base import Family, ImageLayout, ModelSpec, TileBudget, TilingPolicy, to_rgb
from .folder import ModelFolder, ModelFolderError, processor_value, read_model_folder
from .registry import (
                       DEMO_FAMILY,
                       families,
                       family,
                       family_for_model_type,
                       load_model,
                       model_sizes,
                       model_types,
                       policy_from_dict,
                       presets,
                       register,
                       source_tiling,
                       tiny_folder,
)

__all__ = ["DEMO_FAMILY", "Family", "ImageLayout", "ModelFolder", "ModelFolderError", "ModelSpec",
           "TileBudget", "TilingPolicy", "families", "family", "family_for_model_type",
           "load_model", "model_sizes", "model_types", "policy_from_dict", "presets",
           "processor_value", "read_model_folder", "register", "source_tiling", "tiny_folder",
           "to_rgb"]
