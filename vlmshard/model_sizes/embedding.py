"""The LLM's token embedding: a lookup into its table, which a model tying its LM head to it
(``LLMConfig.tied_embeddings``) holds once for both; on a sequence-parallel rank, after its
share's media features are exchanged into token order (``media_exchange``)."""

from __future__ import annotations

from .configs import LLMConfig, ModelConfig
from .memory import FP32, INT64, Saves
from .work import LayerWork, CostTerms


def tied_table_params(t: LLMConfig) -> int:
    """The parameters the token embedding and the LM head share: the table, where tied."""
    return t.vocab_size * t.hidden if t.tied_embeddings else 0


def media_exchange(config: ModelConfig, saves: Saves) -> tuple[CostTerms, CostTerms]:
    """What a sequence-parallel rank's media exchange (``Exchange.media_rows``: each rank's own
    media features sent to the shares whose image tokens they fill, put in token order) keeps
    and holds at once beyond the lookup's, per unit of ``CostTerms`` (nothing at ``sp`` 1). It
    exchanges the features and each DeepStack level's (Qwen3-VL), hidden-wide rows per image
    token; it keeps the int64 index that orders what the rank gets, and the lookup keeps its
    share's image-token rows, not its own tiles' (the rows it sends are indexed per own tile
    instead): per image token of the share, counted per token (its most). It holds per own
    tile the rows it sends, and per image token of its share those it gets and their order."""
    if saves.sp == 1:
        return CostTerms(), CostTerms()
    rows = (1 + len(config.vision.deepstack)) * saves.element_bytes * config.llm.hidden
    return (CostTerms(tokens=2 * INT64),
            CostTerms(tiles=rows * config.tokens_per_tile, tokens=2 * rows))


def token_embedding(config: ModelConfig, saves: Saves) -> LayerWork:
    """The token embedding: a lookup keeping its int64 ids and the int64 rows the image tokens'
    features are copied to; its backward holds its output, that output's gradient with the
    image tokens' rows zeroed, the image features' gradient, the gradient in fp32 where the
    table's accumulates, and the table's fp32 gradient; on a sequence-parallel rank, what its
    media exchange keeps and holds besides (``media_exchange``)."""
    t, a = config.llm, saves.element_bytes
    table = t.vocab_size * t.hidden
    kept, held = media_exchange(config, saves)
    return LayerWork("embed_tokens", table, CostTerms(),
                     CostTerms(tokens=INT64, tiles=INT64 * config.tokens_per_tile) + kept,
                     CostTerms(tokens=a * t.hidden),
                     transient_bytes=CostTerms(tokens=(3 * a + FP32) * t.hidden) + held,
                     fixed_transient_bytes=FP32 * table,
                     tied_params=tied_table_params(t),
                     weight_only_bytes=CostTerms(tokens=INT64))  # the ids index the table alone
