"""The cost model of ``../shared/DESIGN.md``: what one micro-batch costs on each resource.

``vit_cost = a_v·Σtiles`` and ``llm_cost = a_t·Σseq_len + b·Σseq_len²`` (packed samples attend
only within themselves, so attention is quadratic per sample). Defaults are the training FLOPs
(forward + backward = 3× forward) of a model preset, from its layer sizes (``vlmshard/model_sizes.py``);
``vlmshard train profile`` writes a measured ``cost_model.json`` with the same three keys.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from vlmshard.io import read_json


@dataclass(frozen=True)
class CostModel:
    a_v: float  # per ViT tile
    a_t: float  # per LLM token
    b: float  # per squared sequence length of one packed sample
    origin: str  # where the numbers came from: a model name or a cost_model.json

    @classmethod
    def from_preset(cls, name: str) -> "CostModel":
        """Training FLOPs of a model preset (``vlmshard.model_sizes.PRESETS``), from its layer sizes."""
        from vlmshard.model_sizes import training_flops
        from vlmshard.model_sizes import PRESETS

        if name not in PRESETS:
            raise ValueError(f"unknown model {name!r}; known: {', '.join(sorted(PRESETS))}")
        flops = training_flops(PRESETS[name])
        return cls(flops.tiles, flops.tokens, flops.squares, f"flops:{name}")

    @classmethod
    def for_stats(cls, name: str | None, family: str) -> "CostModel":
        """The FLOPs of preset ``name`` (default: the family's), checked to count the ViT in the
        unit the stats do: a preset of other units would weigh tiles against tokens wrongly."""
        from vlmshard.model_sizes import DEFAULT_PRESETS, PRESETS

        name = name or DEFAULT_PRESETS[family]
        preset, default = PRESETS.get(name), PRESETS[DEFAULT_PRESETS[family]]
        if preset is not None and preset.vision.image_size != default.vision.image_size:
            raise ValueError(f"model {name!r} counts {preset.vision.image_size}-px ViT units, but "
                             f"the stats count {family}'s {default.vision.image_size}-px units: "
                             f"pass --model {DEFAULT_PRESETS[family]} or a --cost-model file")
        return cls.from_preset(name)

    @classmethod
    def from_json(cls, path: str) -> "CostModel":
        data = read_json(path)
        try:
            a_v, a_t, b = (float(data[k]) for k in ("a_v", "a_t", "b"))
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{path}: a cost model needs numbers a_v, a_t and b") from None
        if min(a_v, a_t, b) < 0 or a_v + a_t + b <= 0:
            raise ValueError(f"{path}: cost coefficients must be non-negative and not all zero")
        return cls(a_v, a_t, b, f"file:{path}")

    def cost(self, tiles, tokens, squares):
        """Cost of micro-batches (or ranks) from their Σtiles, Σtokens and Σseq_len²."""
        return self.a_v * tiles + self.a_t * tokens + self.b * squares

    def to_dict(self) -> dict:
        return asdict(self)
