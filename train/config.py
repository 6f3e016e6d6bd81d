"""Model shapes: a YAML-readable config and presets (tiny for CPU tests, real sizes for profiling,
the packer's FLOPs cost model and simulation). The vision side must turn one tile into exactly the ``tokens_per_tile`` image
tokens the shards were tokenized with: (image_size / patch_size × downsample_ratio)²."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class VisionConfig:
    image_size: int = 448
    patch_size: int = 14
    hidden: int = 32
    layers: int = 1
    heads: int = 2
    mlp_ratio: float = 4.0


@dataclass(frozen=True)
class LLMConfig:
    vocab_size: int = 131072  # Tekken's; every id the shards can hold needs an embedding
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2  # grouped-query attention: heads share kv_heads key/value heads
    intermediate: int = 128
    rope_theta: float = 1e6
    rms_eps: float = 1e-6


@dataclass(frozen=True)
class ModelConfig:
    name: str = "tiny"
    vision: VisionConfig = field(default_factory=VisionConfig)
    llm: LLMConfig = field(default_factory=LLMConfig)
    downsample_ratio: float = 0.5  # InternVL's pixel shuffle: 4 patches -> 1 token

    @property
    def tokens_per_tile(self) -> int:
        side = self.vision.image_size // self.vision.patch_size
        return int(side * self.downsample_ratio) ** 2

    def validate(self) -> None:
        v, t = self.vision, self.llm
        if v.image_size % v.patch_size:
            raise ValueError(f"image_size {v.image_size} is not a multiple of patch_size "
                             f"{v.patch_size}")
        if v.hidden % v.heads or t.hidden % t.heads or t.heads % t.kv_heads:
            raise ValueError("hidden sizes must divide by heads, and heads by kv_heads")
        if (t.hidden // t.heads) % 2:
            raise ValueError("the LLM head size must be even for rotary embeddings")

    def layer_names(self) -> list[str]:
        """The pipeline's layers in order: the units a stage partition cuts between."""
        return (["vit_embed"] + [f"vit_block_{i}" for i in range(self.vision.layers)]
                + ["projector_merge"] + [f"llm_block_{i}" for i in range(self.llm.layers)]
                + ["head"])

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict | str) -> "ModelConfig":
        """From YAML: a preset name, or sizes over a preset (``{"preset": "tiny", "llm": ...}``)."""
        if isinstance(d, str):
            d = {"preset": d}
        d = dict(d)
        if d.get("preset", "tiny") not in PRESETS:
            raise ValueError(f"unknown model preset {d['preset']!r}; known: {', '.join(PRESETS)}")
        base = PRESETS[d.pop("preset")] if "preset" in d else cls()
        vision = {**asdict(base.vision), **d.pop("vision", {})}
        llm = {**asdict(base.llm), **d.pop("llm", {})}
        merged = {**{k: v for k, v in asdict(base).items() if k not in ("vision", "llm")}, **d}
        config = cls(vision=VisionConfig(**vision), llm=LLMConfig(**llm), **merged)
        config.validate()
        return config


PRESETS = {
    # CPU tests: every code path, seconds per step.
    "tiny": ModelConfig(),
    # InternVL2-2B: InternViT-300M-448px + InternLM2-1.8B.
    "internvl2-2b": ModelConfig(
        name="internvl2-2b",
        vision=VisionConfig(hidden=1024, layers=24, heads=16),
        llm=LLMConfig(vocab_size=92553, hidden=2048, layers=24, heads=16, kv_heads=8,
                      intermediate=8192)),
    # InternVL-Chat-V1.5: InternViT-6B-448px-V1-5 + InternLM2-Chat-20B (OmniBal's main setting).
    "internvl-chat-1.5": ModelConfig(
        name="internvl-chat-1.5",
        vision=VisionConfig(hidden=3200, layers=45, heads=25),
        llm=LLMConfig(vocab_size=92544, hidden=6144, layers=48, heads=48, kv_heads=8,
                      intermediate=16384)),
}
