"""A model's sizes: its ViT, its LLM and how the projector joins them, as a family reads them
from a model folder's ``config.json`` (``vlmshard.families``) or names them in a preset."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from ..errors import ConfigError

# The projectors a ``ModelConfig`` can name, each built by ``projector.PROJECTORS``
PROJECTOR_KINDS = ("mlp", "merger", "pool")


@dataclass(frozen=True)
class VisionConfig:
    image_size: int = 448
    patch_size: int = 14
    hidden: int = 32
    layers: int = 1
    heads: int = 2
    mlp_ratio: float = 4.0
    # rows of the learned position table: -1 one per patch of a tile (InternViT's), 0 none
    # (Qwen2-VL: rotary only), n a table of n interpolated to each image (Qwen3-VL)
    position_embeddings: int = -1
    temporal_patch: int = 1  # frames a patch spans (Qwen's 2: an image's frame repeated)
    deepstack: tuple[int, ...] = ()  # blocks whose output a DeepStack merger reads (Qwen3-VL)
    gated_mlp: bool = False  # a SwiGLU MLP (gate, up, down) of mlp_ratio × hidden (Qwen2.5-VL)
    rms_norm: bool = False  # RMSNorms, no bias (Qwen2.5-VL), instead of LayerNorms
    patch_bias: bool = True  # the patch embedding's bias (Qwen2-VL's and Qwen2.5-VL's have none)
    qkv_bias: bool = True  # biases on q, k and v (InternViT-6B and HF's InternViT default: none)
    layer_scale: bool = False  # a learned scale per channel on each residual branch (InternViT)
    cls_token: bool = False  # a class token and its position row (InternViT)
    # a LayerNorm over the last block's output, class token included, before the projector
    # (InternViT's ``layernorm`` where ``use_mean_pooling`` is false; an identity otherwise)
    final_norm: bool = False
    # Qwen's ViTs: one qkv matrix, rotary positions (tables in fp32), attention across each
    # image (each temporal step of a video), not within a tile, with the outputs concatenated:
    # its FLOPs follow ``CostTerms.vit_squares`` (``vit_attention_size``)
    fused_qkv: bool = False
    # Qwen2.5-VL: its blocks but ``full_blocks`` attend within windows of ``window`` × ``window``
    # tiles (``CostTerms.vit_windows``; 0: no windows)
    window: int = 0
    full_blocks: tuple[int, ...] = ()
    quick_gelu: bool = False  # x·sigmoid(1.702·x): keeps one MLP hidden more than gelu (Qwen2-VL)


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
    head_dim: int = 0  # 0: hidden / heads; Qwen3 states its own
    qk_norm: bool = False  # an RMSNorm over each head's queries and keys (Qwen3)
    qkv_bias: bool = False  # biases on the q, k and v projections (Qwen2)
    # Mixture of experts: a router over ``experts`` SwiGLU experts of ``moe_intermediate``, each
    # token through ``experts_per_token`` of them, in every layer but ``dense_layers``
    experts: int = 0
    experts_per_token: int = 0
    moe_intermediate: int = 0
    dense_layers: tuple[int, ...] = ()
    shared_expert_intermediate: int = 0  # an always-on SwiGLU expert, gated (Qwen3.5-MoE)
    attention_gate: bool = False  # attention output gated per channel by q_proj (Qwen3.5)
    # Linear attention (Gated DeltaNet, Qwen3.5): these layers mix tokens by a causal depthwise
    # conv1d of ``linear_conv_kernel`` and a recurrent state per value head: no attention, so
    # nothing quadratic in a sample's length
    linear_layers: tuple[int, ...] = ()
    linear_key_heads: int = 0
    linear_value_heads: int = 0
    linear_key_dim: int = 0
    linear_value_dim: int = 0
    linear_conv_kernel: int = 4
    # Sliding-window attention (Gemma 3's local layers): a query sees the ``sliding_window``
    # tokens up to it, so these layers cost w·(2·len − w) a sample past the window, not len²
    sliding_window: int = 0
    sliding_layers: tuple[int, ...] = ()
    sandwich_norms: bool = False  # norms after attention and after the MLP too (Gemma)
    # RMSNorms scaling by (1 + weight) in fp32 (Gemma's, Qwen3.5's): they keep their normalized
    # values in fp32, where the others keep them in the activations' dtype
    offset_norms: bool = False
    # the LM head's weight is the token embedding's table (``tie_word_embeddings``, as the
    # model's ``transformers`` config class reads it): a stage holding both holds it once
    tied_embeddings: bool = False

    @property
    def head_size(self) -> int:
        return self.head_dim or self.hidden // self.heads

    def is_moe(self, layer: int) -> bool:
        return self.experts > 0 and layer not in self.dense_layers

    def is_linear(self, layer: int) -> bool:
        return layer in self.linear_layers

    def is_sliding(self, layer: int) -> bool:
        return layer in self.sliding_layers

    @classmethod
    def from_hf_config(cls, config: dict, features: "LLMFeatures") -> "LLMConfig":
        """The LLM sizes of a Hugging Face VLM ``config.json``: its ``text_config`` (older
        Qwen2-VL files keep them at the top level), with the ``features`` its family states."""
        text = {**{k: v for k, v in config.items() if k not in ("vision_config", "text_config")},
                **(config.get("text_config") or {})}
        heads = text["num_attention_heads"]
        rope = text.get("rope_theta") or (text.get("rope_parameters") or {}).get("rope_theta")
        experts = text.get("num_experts") or text.get("num_local_experts") or 0
        step = text.get("decoder_sparse_step") or 1
        dense = tuple(i for i in range(text["num_hidden_layers"])
                      if i in (text.get("mlp_only_layers") or ()) or (i + 1) % step)
        kinds = list(enumerate(text.get("layer_types") or ()))
        linear = tuple(i for i, kind in kinds if kind == "linear_attention")
        sliding = tuple(i for i, kind in kinds if kind == "sliding_attention")
        return cls(vocab_size=text["vocab_size"], hidden=text["hidden_size"],
                   layers=text["num_hidden_layers"], heads=heads,
                   kv_heads=text.get("num_key_value_heads") or heads,
                   intermediate=text["intermediate_size"], rope_theta=float(rope or 1e6),
                   rms_eps=float(text.get("rms_norm_eps", 1e-6)),
                   head_dim=text.get("head_dim") or 0,
                   qk_norm=features.qk_norm,
                   qkv_bias=bool(text.get("attention_bias", features.qkv_bias)),
                   experts=experts, experts_per_token=text.get("num_experts_per_tok") or 0,
                   moe_intermediate=text.get("moe_intermediate_size") or 0,
                   dense_layers=dense if experts else (),
                   shared_expert_intermediate=text.get("shared_expert_intermediate_size") or 0,
                   attention_gate=features.attention_gate,
                   linear_layers=linear,
                   linear_key_heads=text.get("linear_num_key_heads", 0) if linear else 0,
                   linear_value_heads=text.get("linear_num_value_heads", 0) if linear else 0,
                   linear_key_dim=text.get("linear_key_head_dim", 0) if linear else 0,
                   linear_value_dim=text.get("linear_value_head_dim", 0) if linear else 0,
                   linear_conv_kernel=text.get("linear_conv_kernel_dim", 4),
                   sliding_window=(text.get("sliding_window") or 0) if sliding else 0,
                   sliding_layers=sliding, sandwich_norms=features.sandwich_norms,
                   offset_norms=features.offset_norms)


@dataclass(frozen=True)
class LLMFeatures:
    """What an LLM's layers are built with that its ``config.json`` does not say (its
    ``transformers`` modeling code does), each as ``LLMConfig``'s field of that name: the
    family states them (``vlmshard.families``), so a new family's are never guessed."""

    qk_norm: bool = False
    qkv_bias: bool = False  # where config.json has no ``attention_bias`` (Qwen2's: biases)
    attention_gate: bool = False
    sandwich_norms: bool = False
    offset_norms: bool = False


@dataclass(frozen=True)
class ModelConfig:
    name: str = "tiny"
    vision: VisionConfig = field(default_factory=VisionConfig)
    llm: LLMConfig = field(default_factory=LLMConfig)
    downsample_ratio: float = 0.5  # InternVL's pixel shuffle: 4 patches -> 1 token
    # the projector over the ViT's patches: one of ``PROJECTOR_KINDS``, which the family names
    projector: str = "mlp"

    @property
    def tokens_per_tile(self) -> int:
        side = self.vision.image_size // self.vision.patch_size
        return int(side * self.downsample_ratio) ** 2

    @property
    def patches_per_tile(self) -> int:
        return (self.vision.image_size // self.vision.patch_size) ** 2

    @property
    def shuffled_width(self) -> int:
        """The channels of an image token before the projector: the ViT's hidden of the
        1 / downsample_ratio² patches it merges (InternVL's pixel shuffle, Qwen's merger)."""
        return int(self.vision.hidden / self.downsample_ratio ** 2)

    def validate(self) -> None:
        v, t = self.vision, self.llm
        if v.image_size % v.patch_size:
            raise ConfigError(f"image_size {v.image_size} is not a multiple of patch_size "
                             f"{v.patch_size}")
        if v.hidden % v.heads or (not t.head_dim and t.hidden % t.heads) or t.heads % t.kv_heads:
            raise ConfigError("hidden sizes must divide by heads, and heads by kv_heads")
        if t.experts and not (0 < t.experts_per_token <= t.experts and t.moe_intermediate):
            raise ConfigError("a MoE LLM needs experts_per_token in 1..experts and a "
                              "moe_intermediate size")
        if self.projector not in PROJECTOR_KINDS:
            raise ConfigError(f"projector {self.projector!r} is none of "
                              f"{', '.join(PROJECTOR_KINDS)}")
        if any(not 0 <= i < v.layers for i in v.deepstack):
            raise ConfigError(f"deepstack blocks {list(v.deepstack)} are not ViT blocks "
                              f"0..{v.layers - 1}")
        if any(not 0 <= i < v.layers for i in v.full_blocks):
            raise ConfigError(f"full-attention blocks {list(v.full_blocks)} are not ViT blocks "
                              f"0..{v.layers - 1}")
        if v.window and not v.fused_qkv:
            raise ConfigError("ViT windows are windows of an image: a ViT attending within each "
                              "tile (fused_qkv false) has none")
        if t.head_size % 2:
            raise ConfigError("the LLM head size must be even for rotary embeddings")

    def layer_names(self) -> list[str]:
        """The pipeline's layers in order: the units a stage partition cuts between."""
        return (["vit_embed"] + [f"vit_block_{i}" for i in range(self.vision.layers)]
                + ["projector_merge"] + [f"llm_block_{i}" for i in range(self.llm.layers)]
                + ["head"])

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        """Inverse of ``to_dict`` (pipeline.json's record): sizes over the defaults, every one
        type-checked, as the other options."""
        from ..config import load_section

        d, base = dict(d), cls()
        vision = load_section(VisionConfig, {**asdict(base.vision), **d.pop("vision", {})},
                              "model.vision")
        llm = load_section(LLMConfig, {**asdict(base.llm), **d.pop("llm", {})}, "model.llm")
        top = {k: v for k, v in asdict(base).items() if k not in ("vision", "llm")}
        config = load_section(cls, {**top, **d}, "model", vision=vision, llm=llm)
        config.validate()
        return config
