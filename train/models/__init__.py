"""Each family's trainer layer map: a module per map (every module here but the shared
``layers``, ``linear_attention`` and ``liger``; families that share one, as Qwen3-VL and
Qwen3.5 do, name the same) whose ``layers(model)`` lists the pipeline layers of its
``transformers`` model in order, over the shared layers of ``layers``; a family names its map
in ``trainer_layers`` (``vlmshard.families``). Weights are read as ``transformers``' own
conversion mapping renames them (``vlmshard.train.weights``), so a map holds no checkpoint
names of its own.

    vision embedding, each vision block, projector / merger        (``Phase`` per tile)
    token embedding with the image features scattered in,
    each decoder layer, final norm                                  (``Phase`` per token)
    LM head with the summed next-token loss
"""
