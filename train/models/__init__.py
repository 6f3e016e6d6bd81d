"""Each family's trainer layer map: a module per family (``internvl``, ``qwen2vl``,
``qwen3vl``) whose ``layers(model)`` lists the pipeline layers of its ``transformers`` model in
order, over the shared layers of ``layers``; a family names its map in ``trainer_layers``
(``vlmshard.families``).

    vision embedding, each vision block, projector / merger        (``Phase`` per tile)
    token embedding with the image features scattered in,
    each decoder layer, final norm                                  (``Phase`` per token)
    LM head with the summed next-token loss
"""
