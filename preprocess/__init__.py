"""Preprocess stage: conversations and images → the stats table (Contract 1 of DESIGN.md).

Public API::

    from vlmshard.preprocess import PreprocessConfig, run_preprocess
    result = run_preprocess(PreprocessConfig(inputs=["meta.json"], out="out/"))
"""

from .job import ConfigError, PreprocessConfig, PreprocessResult, RejectRatioExceeded, run_preprocess

__all__ = ["ConfigError", "PreprocessConfig", "PreprocessResult", "RejectRatioExceeded",
           "run_preprocess"]
