"""The cost model of ``../shared/DESIGN.md``: what one micro-batch costs on each resource.

``vit_cost = a_v·Σtiles`` and ``llm_cost = a_t·Σseq_len + b·Σseq_len²`` (packed samples attend only
within themselves, so attention is quadratic per sample). Defaults are training FLOPs (forward +
backward = 3× forward) of a named model; ``vlmshard train profile`` writes a measured
``cost_model.json`` with the same three keys.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from vlmshard.io import read_json


@dataclass(frozen=True)
class ModelShape:
    """The sizes that set FLOPs per tile and per token."""

    vit_params: float
    vit_layers: int
    vit_hidden: int
    vit_tokens_per_tile: int  # patches per tile, e.g. (448 / 14)² = 1024
    llm_params: float  # non-embedding parameters
    llm_layers: int
    llm_hidden: int


MODEL_SHAPES = {
    # InternViT-300M + InternLM2-1.8B (InternVL2-2B).
    "internvl2-2b": ModelShape(0.3e9, 24, 1024, 1024, 1.6e9, 24, 2048),
    # InternViT-6B + InternLM2-20B (InternVL-Chat-1.5, OmniBal's main setting).
    "internvl-chat-1.5": ModelShape(5.9e9, 45, 3200, 1024, 19.9e9, 48, 6144),
}
DEFAULT_MODEL = "internvl2-2b"


@dataclass(frozen=True)
class CostModel:
    a_v: float  # per ViT tile
    a_t: float  # per LLM token
    b: float  # per squared sequence length of one packed sample
    origin: str  # where the numbers came from: a model name or a cost_model.json

    @classmethod
    def from_shape(cls, name: str) -> "CostModel":
        if name not in MODEL_SHAPES:
            raise ValueError(f"unknown model {name!r}; known: {', '.join(sorted(MODEL_SHAPES))}")
        s = MODEL_SHAPES[name]
        p = s.vit_tokens_per_tile
        # Forward FLOPs ×3 for training. ViT attention is inside a tile, so it is linear in tiles.
        a_v = 3 * (2 * s.vit_params * p + 4 * s.vit_layers * s.vit_hidden * p * p)
        a_t = 3 * 2 * s.llm_params
        b = 3 * 2 * s.llm_layers * s.llm_hidden  # causal QKᵀ and AV: 2·s²·d per layer
        return cls(a_v, a_t, b, f"flops:{name}")

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
