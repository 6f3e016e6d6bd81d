"""The torch and transformers releases vlmshard supports, in one place (``setup.cfg`` states the
same ranges; the Makefile installs torch itself, so no requirement there pulls a CUDA build).
Checked where they matter, since an install without dependencies (``pip --no-deps``, a GPU
image's own packages) skips setup.cfg's.

torch's variable-length attention changed its signature within the range (2.10: ``is_causal``,
no ``scale`` or ``window_size``; 2.10 and 2.11: no ``enable_gqa``): ``vlmshard.train.attention``
calls it as the installed release defines it. Importing this module imports neither.
"""

from __future__ import annotations

import importlib.metadata

from .errors import ConfigError

# [low, high) as "major.minor"
SUPPORTED_TORCH = ("2.10", "2.14")
# Before 5.18 Qwen2.5-VL's get_rope_index placed the text after a video elsewhere than the
# shards' positions (which follow the model's own code); before 5.19 a Qwen ViT handed packed
# inputs' flash arguments twice (its attention passes **kwargs beside cu_seq_lens_q).
SUPPORTED_TRANSFORMERS = ("5.19", "6.0")


def release(version: str) -> tuple[int, int]:
    """(major, minor) of a version string: ``"2.11.0+cu130"`` -> ``(2, 11)``."""
    major, minor = version.split(".")[:2]
    return int(major), int(minor)


def check_torch() -> None:
    """Raise ``ConfigError`` (one line) when the installed torch is outside ``SUPPORTED_TORCH``."""
    import torch

    _check("torch", torch.__version__, SUPPORTED_TORCH)


def check_transformers() -> None:
    """Raise ``ConfigError`` (one line) when the installed transformers is outside
    ``SUPPORTED_TRANSFORMERS`` (read from its distribution: importing it takes a second)."""
    _check("transformers", importlib.metadata.version("transformers"), SUPPORTED_TRANSFORMERS)


def _check(package: str, version: str, supported: tuple[str, str]) -> None:
    low, high = supported
    if not release(low) <= release(version) < release(high):
        raise ConfigError(f"{package} {version} is installed; vlmshard supports "
                          f"{package}>={low},<{high}: install a release in that range")
