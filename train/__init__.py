"""The train stage: a Hugging Face VLM folder of a family vlmshard knows, fine-tuned on
DeepSpeed's pipeline engine from pre-balanced shards; its layer-by-layer profile and the stage
partition and per-stage recompute it trains with (see ``docs/design.md``, "Trainer")."""
