"""The LLM's token embedding: a lookup into its table, which a model tying its LM head to it
(``LLMConfig.tied_embeddings``) holds once for both."""

from __future__ import annotations

from .configs import LLMConfig
from .memory import FP32, INT64
from .work import LayerWork, CostTerms


def tied_table_params(t: LLMConfig) -> int:
    """The parameters the token embedding and the LM head share: the table, where tied."""
    return t.vocab_size * t.hidden if t.tied_embeddings else 0


def token_embedding(t: LLMConfig, tokens_per_tile: int, a: int) -> LayerWork:
    """The token embedding: a lookup keeping its int64 ids and the int64 rows the image tokens'
    features are copied to; its backward holds its output, that output's gradient with the
    image tokens' rows zeroed, the image features' gradient, the gradient in fp32 where the
    table's accumulates, and the table's fp32 gradient; ``a``: an activation element's bytes."""
    table = t.vocab_size * t.hidden
    return LayerWork("embed_tokens", table, CostTerms(),
                     CostTerms(tokens=INT64, tiles=INT64 * tokens_per_tile),
                     CostTerms(tokens=a * t.hidden),
                     transient_bytes=CostTerms(tokens=(3 * a + FP32) * t.hidden),
                     fixed_transient_bytes=FP32 * table,
                     tied_params=tied_table_params(t),
                     weight_only_bytes=CostTerms(tokens=INT64))  # the ids index the table alone
