"""The torch releases vlmshard supports, in one place (``setup.cfg`` states the same range; the
Makefile installs torch itself, so no requirement there pulls a CUDA build).

torch's variable-length attention changed its signature within the range (2.10: ``is_causal``,
no ``window_size``; 2.10 and 2.11: no ``enable_gqa``): ``vlmshard.train.attention`` calls it as
the installed release defines it. Importing this module imports no torch.
"""

from __future__ import annotations

from .errors import ConfigError

# torch>=2.10,<2.14: [low, high) as "major.minor"
SUPPORTED_TORCH = ("2.10", "2.14")


def release(version: str) -> tuple[int, int]:
    """(major, minor) of a version string: ``"2.11.0+cu130"`` -> ``(2, 11)``."""
    major, minor = version.split(".")[:2]
    return int(major), int(minor)


def check_torch() -> None:
    """Raise ``ConfigError`` (one line) when the installed torch is outside ``SUPPORTED_TORCH``."""
    import torch

    low, high = SUPPORTED_TORCH
    if not release(low) <= release(torch.__version__) < release(high):
        raise ConfigError(f"torch {torch.__version__} is installed; vlmshard supports "
                          f"torch>={low},<{high}: install a release in that range")
