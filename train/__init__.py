"""The train stage: an InternVL-style VLM on DeepSpeed's pipeline engine, its profile, stage
partition and recompute search (see ../shared/DESIGN.md, "Trainer")."""
