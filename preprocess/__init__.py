"""Preprocess stage: conversations and images → the stats table (Contract 1 of
``docs/design.md``).

Public API::

    from vlmshard.preprocess import PreprocessConfig, run_preprocess
    result = run_preprocess(PreprocessConfig(inputs=["meta.json"], out="out/"))

For later stages (the shard writer): ``RecordedPreprocess`` reads what a run recorded in its
``preprocess.json``, and ``Retokenizer`` rebuilds token ids from the sources when the stats did
not keep them (``RetokenizeError`` names a sample that changed); see ``retokenize``.

The names load on first use, so importing the command line's option definitions stays light.
"""

from importlib import import_module

_PUBLIC = {"ConfigError": "vlmshard.config", "PreprocessConfig": ".config",
           "PreprocessResult": ".job", "RejectRatioExceeded": ".job",
           "NothingAccepted": ".job", "run_preprocess": ".job",
           "RecordedPreprocess": ".retokenize", "RetokenizeError": ".retokenize",
           "Retokenizer": ".retokenize", "SampleSpec": ".sample", "SourceRows": ".retokenize",
           "EMBEDDED": ".conversation",
           "sample_where": ".retokenize"}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(_PUBLIC[name], __name__), name)
