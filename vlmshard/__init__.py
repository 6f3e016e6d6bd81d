"""vlmshard: pre-balanced WebDataset shards and a balanced DeepSpeed pipeline trainer for VLMs.

The stages live in the top-level packages ``preprocess``, ``packing``, ``shards`` and ``train``;
this package holds the ``vlmshard`` console command and the small helpers every stage shares.
"""

__version__ = "0.1.0"
