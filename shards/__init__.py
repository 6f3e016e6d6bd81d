"""The shards stage: a plan and its stats table in, pre-balanced WebDataset shards out
(Contract 3 of ``docs/design.md``): the writer, ``verify``, and the streaming loader the trainer
reads them with."""
