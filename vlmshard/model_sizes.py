"""Model sizes and what each pipeline layer costs, computed from them: torch-free, read by
packing (its default cost model), train (model shapes, FLOPs per step) and simulate.

The sizes of a model come from its family (``vlmshard.families``): those a model folder's
``config.json`` states, with the features the family knows its layers have (``LLMFeatures``),
or one of the family's named presets, for profiling, the packer's FLOPs cost model and
simulation. A model's ViT unit (``image_size``) must be the one its family's stats count (a
448-px tile, a 28-px or 32-px merged patch, a whole image). The vision side must turn one tile
into exactly the ``tokens_per_tile`` image tokens the shards were tokenized with: (image_size /
patch_size x downsample_ratio)^2. An LLM's FLOPs count what a token runs through: for a MoE layer
its router and its ``experts_per_token`` experts (active parameters), while its memory holds all
of them.

Every layer cost is linear in the sizes of a micro-batch (``Size``); the packer balances three of
them: Σtiles, Σtokens and Σseq_len² (packed samples attend only within themselves; only attention
layers have the last term, a linear-attention layer costs linear in tokens). A Qwen ViT attends
across each image, so its blocks' FLOPs also follow Σ P² over images of P patches, which the
trainer's MFU and the replay count and the packer leaves out (``vit_attention_size``).
``vlmshard train profile`` measures the same quantities on a real device; the functions here
are its analytic twin. Conventions: forward FLOPs count a multiply-add as 2 (backward is 2x
forward); activations are bf16 (2 bytes) with memory-efficient attention, so no score matrix is
kept, and are counted as ``transformers``' modules save them (fp32 where they upcast); parameters
cost what the trainer's engine holds per parameter (``bytes_per_param``: 20 bytes in bf16 at DP=1).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, fields, replace

from .errors import ConfigError
from .recipe import Lora, Recipe, flops_factor


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
    # Qwen's ViTs: one qkv matrix, rotary positions (tables in fp32), attention across each
    # image (each temporal step of a video), not within a tile, with the outputs concatenated:
    # its FLOPs follow ``Size.vit_squares`` (``vit_attention_size``)
    fused_qkv: bool = False
    # Qwen2.5-VL: its blocks but ``full_blocks`` attend within windows of ``window`` × ``window``
    # tiles (``Size.vit_windows``; 0: no windows)
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
    # the projector over the ViT's patches: a kind of ``PROJECTORS``, which the family names
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
        if self.projector not in PROJECTORS:
            raise ConfigError(f"projector {self.projector!r} is none of {', '.join(PROJECTORS)}")
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
        from .config import load_section

        d, base = dict(d), cls()
        vision = load_section(VisionConfig, {**asdict(base.vision), **d.pop("vision", {})},
                              "model.vision")
        llm = load_section(LLMConfig, {**asdict(base.llm), **d.pop("llm", {})}, "model.llm")
        top = {k: v for k, v in asdict(base).items() if k not in ("vision", "llm")}
        config = load_section(cls, {**top, **d}, "model", vision=vision, llm=llm)
        config.validate()
        return config


ACTIVATION_BYTES = 2  # bf16
FP32 = 4
LOSS_CHUNK = 1024  # rows of logits the LM loss makes at a time (vlmshard.train's lm_loss)
# what a checkpointed (recomputed) layer keeps besides tensors: the CPU generator's state,
# saved to replay its randomness (torch's Mersenne Twister: 5056 bytes)
CHECKPOINT_STATE_BYTES = 5056


@dataclass(frozen=True)
class Saves:
    """Where the kernels a trainer runs keep other tensors for backward than ``transformers``'
    own modules on SDPA (the default: what a CPU run keeps, and what the packer assumes).

    ``vit_one_call``: a Qwen ViT attends over all of a micro-batch's images in one call of
    torch's varlen kernel (``vlmshard.train.attention.packed_varlen``), which keeps q, k, a
    copy of v and its output; split per image, SDPA keeps views of v that hold the whole fused
    qkv output, and the projection keeps the images' outputs concatenated. ``liger_llm`` and
    ``liger_vit``: Liger's kernels in the LLM's (the ViT's) layers: an RMSNorm keeps its input
    and 1/rms per row (not fp32 copies), a gated MLP its gate and up projections (not the
    activation between them). ``kv_repeated``: the LLM's attention kernel is given K/V heads
    repeated to the query heads (torch's varlen kernel before 2.12 takes no grouped-query
    heads), and keeps them so. Compiled blocks are counted as their eager modules."""

    vit_one_call: bool = False
    liger_llm: bool = False
    liger_vit: bool = False
    kv_repeated: bool = False


def rms_norm_kept(width: float, rows: float = 1, offset: bool = False,
                  fused: bool = False) -> float:
    """Bytes a ``transformers`` RMSNorm of ``width`` keeps per token (``rows`` norms a token):
    its input upcast to fp32, 1/rms per row, and the normalized values the weight multiplies,
    in bf16, or in fp32 for a (1 + weight) norm (``LLMConfig.offset_norms``). ``fused``:
    Liger's kernel, which keeps the input as it came and 1/rms in fp32. What reads its output
    keeps that apart."""
    if fused:
        return ACTIVATION_BYTES * width + FP32 * rows
    return FP32 * width + FP32 * rows + (FP32 if offset else ACTIVATION_BYTES) * width


def gated_mlp_kept(intermediate: float, fused: bool = False) -> float:
    """Bytes a gated MLP keeps per token beyond its input: the gate and up projections' outputs,
    the activation of the gate (not with Liger's fused kernel, ``fused``) and the product the
    down projection reads."""
    return (3 if fused else 4) * ACTIVATION_BYTES * intermediate


def rms_norm_backward(width: float) -> float:
    """Bytes an RMSNorm's backward holds per token beyond what the norm keeps: the fp32
    gradients of its chain of ops (input, square, mean, normalized values, weight product)."""
    return 5 * FP32 * width


def layer_norm_kept(width: float) -> float:
    """Bytes a LayerNorm keeps per row: its input, and the mean and 1/std in fp32."""
    return ACTIVATION_BYTES * width + 2 * FP32


def bytes_per_param(precision: str = "bf16", dp: int = 1, grad_accum: str = "fp32",
                    zero: int = 1) -> float:
    """Device bytes per trained parameter that DeepSpeed holds for ``vlmshard train`` with
    torch's AdamW (weights, gradients, master weights, both moments): the larger of what it
    holds through backward and at the optimizer update (``deepspeed_config`` picks the
    optimizer; ``vlmshard.train.engine_memory`` counts the engine's tensors to check this).
    ``dp`` is the data-parallel degree ZeRO splits over. With ``zero=3`` the weights are split
    too: the bytes are per parameter of the whole model, not of one rank's partition; what
    ZeRO-3 holds beyond them is ``zero3_fixed_bytes``. Not included: the copies a gradient
    reduction or flattening makes for a moment.

    - fp32, ZeRO-1: the trainer configures no ZeRO in fp32, so DeepSpeed steps torch's AdamW
      itself, nothing split: weight, gradient and two moments, 16.
    - fp32, ZeRO-2: weight 4; ZeRO's fp32 gradient partition, master copy and moments 16/dp.
    - fp32, ZeRO-3: weight partition, gradient partition buffer, the update's flattened gradient,
      master copy (4/dp each) and moments (8/dp): 24/dp.
    - bf16, ZeRO-1, fp32 accumulation (DeepSpeed's BF16_Optimizer, pipeline or not): bf16
      weight and gradient 4, the whole fp32 accumulation buffer 4, fp32 master and moments
      12/dp.
    - bf16, ZeRO-1, bf16 accumulation (DeepSpeed's ZeRO-1 optimizer): bf16 weight 2, then the
      bf16 gradient through backward (2) or the fp32 gradient partition at the update (4/dp),
      master and moments 12/dp.
    - bf16, ZeRO-2: bf16 weight 2; the gradient partition (4/dp at the update, either
      accumulation), master and moments: 2 + 16/dp.
    - bf16, ZeRO-3: weight partition 2/dp, gradient partition buffer in the accumulation dtype
      (4/dp or 2/dp), the update's fp32 gradient 4/dp, master and moments 12/dp.
    """
    if precision not in ("fp32", "bf16") or grad_accum not in ("fp32", "bf16"):
        raise ConfigError(f"unknown precision {precision!r} or gradient accumulation "
                          f"{grad_accum!r} (bf16 or fp32)")
    if zero not in (1, 2, 3):
        raise ConfigError(f"ZeRO stage {zero!r}: the trainer runs 1, 2 or 3")
    accum = 4 if grad_accum == "fp32" else 2
    if precision == "fp32":
        return {1: 16.0, 2: 4 + 16 / dp, 3: 24 / dp}[zero]
    if zero == 1:
        return 8 + 12 / dp if grad_accum == "fp32" else 2 + max(2, 4 / dp) + 12 / dp
    if zero == 2:
        return 2 + 16 / dp
    return (2 + accum + 4 + 12) / dp


# DeepSpeed's ZeRO-3 settings the trainer leaves at their defaults (deepspeed.runtime.zero.config,
# checked against it by tests/test_model_sizes.py), in elements
ZERO3_REDUCE_BUCKET = 500_000_000  # reduce_bucket_size
ZERO3_PREFETCH_BUCKET = 50_000_000  # stage3_prefetch_bucket_size
ZERO3_MAX_REUSE_DISTANCE = 1_000_000_000  # stage3_max_reuse_distance
ZERO3_PERSISTENCE_THRESHOLD = 100_000  # stage3_param_persistence_threshold


@dataclass(frozen=True)
class Zero3Weights:
    """What ZeRO-3's fixed costs depend on, in elements of the trained weights: all of them,
    those at most the persistence threshold (kept whole on every rank), and the largest set one
    module holds itself (ZeRO-3 gathers a module's own weights together)."""

    total: int
    persistent: int
    largest_module: int


def zero3_fixed_bytes(weights: Zero3Weights, precision: str = "bf16",
                      dp: int = 1) -> dict[str, int]:
    """Bytes a ZeRO-3 rank holds beyond ``bytes_per_param`` times the parameters, which counts
    every weight split over the ``dp`` ranks, by part:

    - ``reduce_bucket``: the gradient reduce buffer, allocated whole for the run whatever the
      model's size (``engine_memory`` counts it apart, as ``buckets``);
    - ``gathered``: weights gathered whole around their use. A released module's weights stay
      gathered where the trace uses them again within the reuse distance, so at once at most
      that distance's worth, the prefetched bucket and the running module's own: at the turn
      from forward to backward, the last layers of the forward (a small model's every weight);
    - ``gradient``: the largest module's whole gradient, before the reduce bucket takes it;
    - ``persistent``: the weights under the persistence threshold, kept whole on every rank
      where ``bytes_per_param`` charged each rank its split.
    """
    width = ACTIVATION_BYTES if precision == "bf16" else FP32
    split = weights.total - weights.persistent
    gathered = min(split, ZERO3_MAX_REUSE_DISTANCE + ZERO3_PREFETCH_BUCKET
                   + weights.largest_module)
    return {"reduce_bucket": ZERO3_REDUCE_BUCKET * width, "gathered": gathered * width,
            "gradient": weights.largest_module * width,
            "persistent": int(width * weights.persistent * (1 - 1 / dp))}


@dataclass(frozen=True)
class Size:
    """The sizes of a micro-batch (or a sum of them) that every cost is linear in: tiles,
    tokens, the LLM's attention and, for a ViT attending across whole images (Qwen's), its
    attention (``vit_attention_size``)."""

    tiles: float = 0.0
    tokens: float = 0.0
    squares: float = 0.0  # Σ seq_len² over packed samples
    # Σ m·(2·seq_len − m), m = min(seq_len, window): a causal sliding-window layer's pairs in
    # the units where full causal attention's are seq_len² (= seq_len² up to the window)
    windowed: float = 0.0
    vit_squares: float = 0.0  # Σ P² over images and videos' temporal steps of P patches
    vit_windows: float = 0.0  # Σ P² over the ViT's windows of P patches (Qwen2.5-VL)

    def dot(self, other: "Size") -> float:
        return sum(getattr(self, k) * getattr(other, k) for k in SIZE_FIELDS)

    def __add__(self, other: "Size") -> "Size":
        return Size(*(getattr(self, k) + getattr(other, k) for k in SIZE_FIELDS))

    def scaled(self, factor: float) -> "Size":
        return Size(*(factor * getattr(self, k) for k in SIZE_FIELDS))

    def windows_as_full(self) -> "Size":
        """These FLOPs with sliding-window layers charged as full attention: for sizes that
        know only Σseq_len² (the simulator's, the default partition's), exact for samples no
        longer than the window and an upper bound beyond."""
        return replace(self, squares=self.squares + self.windowed, windowed=0.0)


SIZE_FIELDS = tuple(f.name for f in fields(Size))


def vit_attention_size(vision: VisionConfig, grids: Iterable[Sequence[int]]) -> Size:
    """The attention sizes of images and videos of ViT patch ``grids`` (t, h, w) for a ViT that
    attends across each image and each temporal step of a video (``VisionConfig.fused_qkv``:
    Qwen's, as ``transformers.vision_utils.get_vision_cu_seqlens`` splits them): Σ P² over
    temporal steps of P = h·w patches; with windows (Qwen2.5-VL, ``get_vision_window_index``)
    Σ P² over each step's windows of ``window`` × ``window`` tiles, the last row and column of
    windows cut at the image's edge. A ViT that attends within a tile has its attention in the
    per-tile FLOPs: empty."""
    if not vision.fused_qkv:
        return Size()
    merge = vision.image_size // vision.patch_size  # a tile: merge × merge patches
    full = windows = 0
    for t, h, w in grids:
        full += t * (h * w) ** 2
        if vision.window:
            rows, cols = (_cut(side // merge, vision.window) for side in (h, w))
            windows += t * merge ** 4 * sum(r * r for r in rows) * sum(c * c for c in cols)
    return Size(vit_squares=full, vit_windows=windows)


def _cut(length: int, window: int) -> list[int]:
    """``length`` in pieces of ``window``, the last one shorter."""
    return [window] * (length // window) + ([length % window] if length % window else [])


@dataclass(frozen=True)
class Mixer:
    """Half of an LLM layer (its token or its channel mixer): parameters, forward FLOPs per unit
    of ``Size``, the bytes it keeps for backward per token, and the widest gradients its
    backward holds at once per token."""

    params: float
    flops: Size
    kept: float
    transient: float = 0.0
    # per token, the outputs of its matmuls and attention kernel: what selective recompute keeps
    # (None: no selective mode, e.g. linear attention's chunked kernel)
    selective: float | None = None
    # per token, of ``kept``, what only its weights' gradients read (its linear layers' inputs
    # no other op keeps): what it does not keep with its weights frozen
    weight_only: float = 0.0


@dataclass(frozen=True)
class LayerWork:
    """One pipeline layer: parameters, and per unit of ``Size`` its forward FLOPs, the activation
    bytes it keeps for backward and the bytes of the activation it hands to the next layer."""

    name: str
    params: int
    flops: Size
    activation_bytes: Size
    output_bytes: Size
    # what its forward + backward hold at once beyond what it keeps and its parameters'
    # gradients (counted with the parameters): its output and that output's gradient, its
    # input's gradient, the widest gradients inside it; and per row of the loss's chunk (the
    # head: logits in fp32, their log-softmax and gradient), up to ``LOSS_CHUNK`` rows
    transient_bytes: Size = Size()
    chunk_row_bytes: float = 0.0
    fixed_transient_bytes: float = 0.0  # the token embedding's fp32 table gradient
    # kept under selective recompute besides the layer's input: its matmuls' and attention
    # kernels' outputs (``vlmshard.train.recompute``); None where a layer has no such mode
    selective_bytes: Size | None = None
    # of ``params``, the table a tied LM head and the token embedding share
    # (``LLMConfig.tied_embeddings``): a stage holding both layers holds it once
    tied_params: int = 0
    # of ``activation_bytes``, what only the weights' gradients read (linear layers' inputs, a
    # norm's normalized values): not kept with the weights frozen (``kept_bytes``)
    weight_only_bytes: Size = Size()
    # LoRA's adapters on the layer (``with_adapters``): trained while ``params`` stay frozen,
    # their forward FLOPs per unit of ``Size``, and what they keep (their linear layers'
    # inputs again, and each adapter's rank-wide hidden)
    adapter_params: int = 0
    adapter_flops: Size = Size()
    adapter_kept_bytes: Size = Size()

    def transient(self, size: Size) -> float:
        """The transient bytes at a micro-batch of ``size``."""
        return (self.transient_bytes.dot(size) + self.chunk_row_bytes * min(size.tokens, LOSS_CHUNK)
                + self.fixed_transient_bytes)



def _vit_norm_kept(v: VisionConfig, fused: bool = False) -> float:
    """Bytes one of the ViT's norms keeps per patch (``fused``: an RMSNorm, Liger's)."""
    return rms_norm_kept(v.hidden, fused=fused) if v.rms_norm else layer_norm_kept(v.hidden)


def _vit_norm_params(v: VisionConfig) -> int:
    """Parameters per channel of one of the ViT's norms: an RMSNorm's weight, a LayerNorm's
    weight and bias."""
    return 1 if v.rms_norm else 2


@dataclass(frozen=True)
class ProjectorWork:
    """A projector per tile: its matrices' multiply-adds per image token, its parameters, and
    the bytes it keeps for backward."""

    linear: float
    params: float
    kept: float


def mlp_projector(c: ModelConfig) -> ProjectorWork:
    """A LayerNorm of the shuffled width, width -> hidden -> hidden (InternVL's ``mlp1``)."""
    width, hidden, a = c.shuffled_width, c.llm.hidden, ACTIVATION_BYTES
    linear = width * hidden + hidden ** 2
    return ProjectorWork(linear, linear + 2 * width + 2 * hidden,
                         c.tokens_per_tile * (layer_norm_kept(width) + a * width + 2 * a * hidden))


def merger_projector(c: ModelConfig) -> ProjectorWork:
    """A norm of each patch, width -> width -> hidden (Qwen's PatchMerger; a DeepStack merger
    norms the width instead)."""
    v, width, a = c.vision, c.shuffled_width, ACTIVATION_BYTES
    linear = width * width + width * c.llm.hidden
    return ProjectorWork(linear, linear + _vit_norm_params(v) * v.hidden + width + c.llm.hidden,
                         c.patches_per_tile * _vit_norm_kept(v) + c.tokens_per_tile * 3 * a * width)


def pool_projector(c: ModelConfig) -> ProjectorWork:
    """The ViT's final norm, an average over each token's patches, an RMSNorm and one matrix
    Hv -> hidden (Gemma 3's projector)."""
    v, a = c.vision, ACTIVATION_BYTES
    linear = v.hidden * c.llm.hidden
    return ProjectorWork(linear, linear + 2 * v.hidden + v.hidden,
                         c.patches_per_tile * (layer_norm_kept(v.hidden) + a * v.hidden)
                         + c.tokens_per_tile * (rms_norm_kept(v.hidden, offset=True)
                                                + a * v.hidden))


# the projector kinds a ``ModelConfig`` names
PROJECTORS = {"mlp": mlp_projector, "merger": merger_projector, "pool": pool_projector}


def layer_work(config: ModelConfig, saves: Saves = Saves()) -> list[LayerWork]:
    """Every pipeline layer of ``config``, in pipeline order (``config.layer_names()``), keeping
    for backward what the kernels ``saves`` describes keep."""
    v, t = config.vision, config.llm
    a = ACTIVATION_BYTES
    patches = config.patches_per_tile
    tokens = config.tokens_per_tile  # image tokens per tile after pixel shuffle
    mlp = int(v.hidden * v.mlp_ratio)
    width = config.shuffled_width
    head_dim = t.head_size
    kv = t.kv_heads * head_dim
    q = t.heads * head_dim
    vit_out = Size(tiles=a * patches * v.hidden)
    llm_out = Size(tokens=a * t.hidden)

    patch_in = 3 * v.temporal_patch * v.patch_size ** 2
    positions = patches if v.position_embeddings < 0 else v.position_embeddings
    embed_params = (patch_in * v.hidden + v.patch_bias * v.hidden + positions * v.hidden
                    + v.cls_token * (2 if v.position_embeddings < 0 else 1) * v.hidden)
    mlp_matrices = 3 if v.gated_mlp else 2
    vit_linear = 4 * v.hidden ** 2 + mlp_matrices * v.hidden * mlp
    # + biases (q, k, v, o; the MLP's), two norms and the layer scales
    vit_params = (vit_linear + (3 * v.qkv_bias + 2) * v.hidden + (mlp_matrices - 1) * mlp
                  + 2 * _vit_norm_params(v) * v.hidden + 2 * v.layer_scale * v.hidden)
    vit_norm_kept = _vit_norm_kept(v, saves.liger_vit)
    projector_work = PROJECTORS[config.projector](config)
    projector_linear = projector_work.linear
    # a DeepStack merger: the merger with its norm over the width
    deepstack_params = projector_linear + 2 * width + width + t.hidden
    # What the LLM's layers keep, in bytes per token, as ``transformers``' own modules save it
    # for backward (tests/test_model.py holds each layer kind to the saved-tensor hooks'
    # count): a norm, and its output as the projections' input.
    offset, fused = t.offset_norms, saves.liger_llm
    normed = rms_norm_kept(t.hidden, offset=offset, fused=fused) + a * t.hidden

    def normalized(width: float) -> float:
        """Of what an RMSNorm keeps, the normalized values only its weight's gradient reads
        (Liger's kernel keeps none: it recomputes them)."""
        return 0.0 if fused else (FP32 if offset else a) * width
    # Beside the widest gradients inside a layer (``Mixer.transient``), its backward holds its
    # output, that output's gradient and its input's gradient, and a norm's fp32 gradients.
    llm_io = 3 * a * t.hidden + rms_norm_backward(t.hidden)
    # The token mixers. Attention: q (doubled when gated), k, v, o; causal attention is
    # 2·s²·heads·head_dim per sample. Keeps: q/k norms, the rotary tables, the kernel's q, k,
    # v (``Saves.kv_repeated``: k and v as wide as q), output and log-sum-exp, o's input (and,
    # gated, the gate's sigmoid and the ungated output).
    attention_linear = (2 + t.attention_gate) * t.hidden * q + 2 * t.hidden * kv
    qk_norms = (rms_norm_kept(q, t.heads, offset, fused)
                + rms_norm_kept(kv, t.kv_heads, offset, fused) if t.qk_norm else 0)
    attention = Mixer(
        params=attention_linear + (2 * head_dim if t.qk_norm else 0) + (q + 2 * kv) * t.qkv_bias,
        flops=Size(tokens=2 * attention_linear, squares=2 * q),
        kept=(normed + qk_norms + 2 * a * head_dim
              + a * (2 * q + 2 * (q if saves.kv_repeated else kv)) + FP32 * t.heads
              + a * q * (1 + 2 * t.attention_gate)),
        # the kernel's fp32 dq accumulator and softmax rows, dq, dk, dv; the q/k norms' fp32
        # gradients
        transient=(FP32 * (q + t.heads) + a * (q + 2 * kv) + 2 * FP32 * (q + kv) * t.qk_norm),
        # q (with its gate), k, v; the kernel's output and log-sum-exp; o
        selective=a * ((1 + t.attention_gate) * q + 2 * kv + q + t.hidden) + FP32 * t.heads,
        # the projections' input; the q/k norms' normalized values; gated, o's input (the
        # gated output: ungated, o reads the kernel's output, which attention keeps anyway)
        weight_only=(a * t.hidden + (normalized(q) + normalized(kv)) * t.qk_norm
                     + a * q * t.attention_gate))
    # sliding-window attention: the same, its quadratic term within the window
    sliding = replace(attention, flops=Size(tokens=2 * attention_linear, windowed=2 * q))
    # Gated DeltaNet: projections to q/k/v (through the conv), the output gate z, a and b per
    # value head; the conv; the chunked delta rule (chunks of C = 64 tokens: per token and value
    # head about 2.5·C·dk + 1.5·C·dv + 3·dk·dv multiply-adds, each sample rounded up to whole
    # chunks not counted). Keeps: q/k/v before and after the conv, b and a; in the delta rule
    # as ``transformers``' torch kernel runs it (fp32, per value head: C×C decay, key and query
    # products and their solved systems, a dozen key- and value-sized rows, the state per
    # chunk); the core output's gated norm and z.
    key_dim = t.linear_key_heads * t.linear_key_dim
    value_dim = t.linear_value_heads * t.linear_value_dim
    conv_dim = 2 * key_dim + value_dim
    linear_linear = t.hidden * (conv_dim + 2 * value_dim + 2 * t.linear_value_heads)
    chunk, dk, dv = 64, t.linear_key_dim, t.linear_value_dim
    linear = Mixer(
        params=linear_linear + conv_dim * t.linear_conv_kernel + 2 * t.linear_value_heads + dv,
        flops=Size(tokens=2 * linear_linear + 2 * conv_dim * t.linear_conv_kernel
                   + 2 * t.linear_value_heads * (2.5 * chunk * dk + 1.5 * chunk * dv
                                                 + 3 * dk * dv)),
        kept=(normed + 2 * a * conv_dim + a * t.linear_value_heads
              + t.linear_value_heads * FP32 * (5 * chunk + 12 * dk + 6 * dv + 10 + 2 * dk * dv
                                               / chunk)
              + value_dim * (3 * FP32 + 3 * a) + FP32 * t.linear_value_heads),
        # the torch kernel's backward: gradients as wide as its fp32 chunk products
        transient=t.linear_value_heads * FP32 * (5 * chunk + 12 * dk + 6 * dv),
        # the projections' input, out_proj's, the gated norm's normalized values and gated
        # output, the decay's fp32 step per value head
        weight_only=a * t.hidden + 3 * a * value_dim + FP32 * t.linear_value_heads)
    # The channel mixers: a SwiGLU MLP, or a MoE layer's router and each token through its
    # experts (active; all of them held), plus a gated shared expert where there is one.
    # Keeps: the norm, the SwiGLU gate, up, activation and product; a MoE layer its router's
    # logits and probabilities, and per chosen expert its gathered input, gate/up, activation,
    # product and output with their indices and weight.
    dense = Mixer(params=3 * t.hidden * t.intermediate,
                  flops=Size(tokens=2 * 3 * t.hidden * t.intermediate),
                  kept=normed + gated_mlp_kept(t.intermediate, fused),
                  transient=3 * a * t.intermediate,
                  selective=a * (2 * t.intermediate + t.hidden),  # gate, up, down
                  weight_only=a * (t.hidden + t.intermediate))  # gate/up's input, down's
    shared = 3 * t.hidden * t.shared_expert_intermediate + (t.hidden if
                                                            t.shared_expert_intermediate else 0)
    expert = 3 * t.hidden * t.moe_intermediate
    sparse = Mixer(
        params=t.hidden * t.experts + t.experts * expert + shared,
        flops=Size(tokens=2 * (t.hidden * t.experts + t.experts_per_token * expert + shared)),
        kept=(normed + (FP32 + a) * t.experts + FP32
              + t.experts_per_token * (2 * a * t.hidden + 4 * a * t.moe_intermediate + 46)
              + (gated_mlp_kept(t.shared_expert_intermediate, fused) + a * t.hidden + 2 * a
                 if t.shared_expert_intermediate else 0)),
        transient=(FP32 * t.experts + t.experts_per_token * (3 * a * t.moe_intermediate
                                                              + 2 * a * t.hidden)
                   + 3 * a * t.shared_expert_intermediate),
        # the router's logits; per chosen expert its gate/up and down; the shared expert's
        selective=(a * t.experts + t.experts_per_token * a * (2 * t.moe_intermediate + t.hidden)
                   + (a * (2 * t.shared_expert_intermediate + t.hidden + 1)
                      if t.shared_expert_intermediate else 0)),
        # the router's input; per chosen expert its gathered input and down's; the shared
        # expert's down's
        weight_only=(a * t.hidden + t.experts_per_token * a * (t.hidden + t.moe_intermediate)
                     + a * t.shared_expert_intermediate))

    def llm_block(i: int) -> dict:
        """Layer i: its token and channel mixers, two norms (four with sandwich norms), and the
        hidden it hands on."""
        token_mixer = (linear if t.is_linear(i) else sliding if t.is_sliding(i) else attention)
        mixers = (token_mixer, sparse if t.is_moe(i) else dense)
        # sandwich norms: their outputs join the residual, nothing else keeps them
        sandwich = (2 * rms_norm_kept(t.hidden, offset=offset, fused=fused) if t.sandwich_norms
                    else 0)
        selective = (None if any(m.selective is None for m in mixers)
                     else Size(tokens=sum(m.selective for m in mixers)))
        return dict(params=sum(m.params for m in mixers) + (2 + 2 * t.sandwich_norms) * t.hidden,
                    flops=Size(tokens=sum(m.flops.tokens for m in mixers),
                               squares=sum(m.flops.squares for m in mixers),
                               windowed=sum(m.flops.windowed for m in mixers)),
                    activation_bytes=Size(tokens=sum(m.kept for m in mixers) + sandwich),
                    weight_only_bytes=Size(tokens=sum(m.weight_only for m in mixers)
                                           + (2 + 2 * t.sandwich_norms) * normalized(t.hidden)),
                    output_bytes=llm_out,
                    transient_bytes=Size(tokens=llm_io + max(m.transient for m in mixers)),
                    selective_bytes=selective)

    embed = LayerWork(
        "vit_embed", embed_params,
        flops=Size(tiles=2 * patch_in * v.hidden * patches),
        # the conv keeps its pixels; a resampled position table its indices and weights
        activation_bytes=Size(tiles=patches * (a * patch_in + (4 * 8 + 4 * FP32) * (
            v.position_embeddings > 0))),  # four neighbours' int64 indices, fp32 weights
        output_bytes=vit_out,
        # no gradient reaches the pixels: the output and its gradient, a copy reordered (Qwen2.5's
        # windows) and its gradient, the conv's workspace; a resampled position table's four
        # neighbours' rows, their weighted sum and gradients
        transient_bytes=Size(tiles=patches * a * v.hidden * (6 + 16 * (
            v.position_embeddings > 0))))
    # Per patch: two norms and their outputs (the projections' inputs); q, k, v, the kernel's
    # output and log-sum-exp (Qwen's: q and k rotated, the fp32 rotary tables, and split per
    # image the fused qkv output and the images' outputs concatenated for the projection, in
    # one varlen call a copy of v: ``Saves.vit_one_call``); the layer scales' inputs; the MLP's
    # hiddens (gelu: fc1's output and its activation; quick_gelu a sigmoid more; SwiGLU gate,
    # up, activation and product, Liger's without the activation).
    if v.fused_qkv:
        rotary = 2 * FP32 * v.hidden // v.heads
        vit_attention = a * v.hidden * (4 if saves.vit_one_call else 7) + rotary
    else:
        vit_attention = 4 * a * v.hidden
    mlp_hiddens = (3 if saves.liger_vit else 4) if v.gated_mlp else 3 if v.quick_gelu else 2
    # backward: output, its gradient, the input's, a norm's fp32 gradients, and the wider of
    # the MLP's hidden gradients and attention's (fp32 dq accumulator, dq, dk, dv)
    vit_transient = patches * (3 * a * v.hidden + 2 * FP32 * v.hidden + max(
        (mlp_hiddens + 1) * a * mlp, FP32 * v.hidden + 3 * a * v.hidden))
    # Attention: q·kᵀ and its product with v, 2·P²·hidden FLOPs each for P patches attending
    # to each other: those of a tile, or for a Qwen ViT those of an image or window, counted
    # per block (``image_attention``)
    vit_flops = Size(tiles=2 * patches * vit_linear
                     + (0 if v.fused_qkv else 4 * patches ** 2 * v.hidden))

    def image_attention(i: int) -> Size:
        """Block i's attention across images or windows, per unit of their squares."""
        if not v.fused_qkv:
            return Size()
        windowed = v.window and i not in v.full_blocks
        return Size(vit_windows=4 * v.hidden) if windowed else Size(vit_squares=4 * v.hidden)

    vit_block = dict(
        params=vit_params,
        flops=vit_flops,
        activation_bytes=Size(tiles=patches * (
            2 * vit_norm_kept + 2 * a * v.hidden + vit_attention + FP32 * v.heads
            + 2 * a * v.hidden * v.layer_scale + mlp_hiddens * a * mlp)),
        output_bytes=vit_out,
        transient_bytes=Size(tiles=vit_transient),
        # q, k, v; the kernel's output and log-sum-exp; the projection; the MLP's first matmul
        # (two, gated) and its second
        selective_bytes=Size(tiles=patches * (a * 6 * v.hidden + FP32 * v.heads
                                              + (1 + v.gated_mlp) * a * mlp)))
    lookup = _token_embedding_work(t, tokens)
    projector = LayerWork(
        "projector_merge", projector_work.params + lookup.params,
        flops=Size(tiles=2 * tokens * projector_linear),
        activation_bytes=Size(tiles=projector_work.kept + lookup.activation_bytes.tiles,
                              tokens=lookup.activation_bytes.tokens),
        output_bytes=llm_out,
        transient_bytes=Size(tiles=patches * (3 * a * v.hidden + rms_norm_backward(v.hidden)
                                              * v.rms_norm)
                             + tokens * (3 * a * width + 2 * a * t.hidden)),
        fixed_transient_bytes=lookup.fixed_transient_bytes, tied_params=lookup.tied_params)
    head = LayerWork(
        "head", t.hidden * t.vocab_size + t.hidden,
        flops=Size(tokens=2 * t.hidden * t.vocab_size),
        # per supervised token (here: every token, the most there can be) its hidden state, its
        # target and index; the logits are chunked and recomputed in backward
        activation_bytes=Size(tokens=a * t.hidden + 16
                              + _final_norm_work(t, saves).activation_bytes.tokens),
        output_bytes=Size(),
        # the hidden rows' gradient, the final norm's backward; per row of a loss chunk its
        # fp32 log-softmax, the gradient in and out of it and the bf16 logits' gradient
        transient_bytes=_final_norm_work(t, saves).transient_bytes,
        chunk_row_bytes=14 * t.vocab_size, tied_params=lookup.tied_params)

    deepstack = dict(  # the block, then its merger (a norm over the width) on its output
        params=vit_params + deepstack_params,
        flops=vit_flops + Size(tiles=2 * tokens * projector_linear),
        activation_bytes=Size(tiles=vit_block["activation_bytes"].tiles
                              + tokens * (layer_norm_kept(width) + 3 * a * width)),
        output_bytes=Size(tiles=vit_out.tiles + a * tokens * t.hidden),
        transient_bytes=Size(tiles=vit_transient + tokens * 3 * a * width),
        selective_bytes=Size(tiles=vit_block["selective_bytes"].tiles
                             + tokens * a * (width + t.hidden)))

    def vit_layer(i: int) -> LayerWork:
        block = deepstack if i in v.deepstack else vit_block
        return LayerWork(f"vit_block_{i}", **{**block, "flops": block["flops"]
                                              + image_attention(i)})

    vit = [vit_layer(i) for i in range(v.layers)]
    llm = [LayerWork(f"llm_block_{i}", **llm_block(i)) for i in range(t.layers)]
    return [embed, *vit, projector, *llm, head]


# The trainer's pipeline layers (vlmshard.train) that the analytic model names otherwise, and
# those it counts as no layer of their own: the token embedding is a lookup (its table and
# what it keeps are projector_merge's), the final norm a rounding error in FLOPs (its weight
# and what it keeps are the head's).
TRAINER_NAMES = {"projector": "projector_merge"}
NO_LAYER_WORK = ("embed_tokens", "final_norm")


def _token_embedding_work(t: LLMConfig, tokens_per_tile: int) -> LayerWork:
    """The token embedding: a lookup keeping its int64 ids and the int64 rows the image tokens'
    features are copied to; its backward holds its output, that output's gradient with the
    image tokens' rows zeroed, the image features' gradient, the gradient in fp32 where the
    table's accumulates, and the table's fp32 gradient."""
    table = t.vocab_size * t.hidden
    return LayerWork("embed_tokens", table, Size(),
                     Size(tokens=8, tiles=8 * tokens_per_tile),
                     Size(tokens=ACTIVATION_BYTES * t.hidden),
                     transient_bytes=Size(tokens=(3 * ACTIVATION_BYTES + FP32) * t.hidden),
                     fixed_transient_bytes=FP32 * table,
                     tied_params=table if t.tied_embeddings else 0,
                     weight_only_bytes=Size(tokens=8))  # the ids index the table alone


def _final_norm_work(t: LLMConfig, saves: Saves) -> LayerWork:
    """The final norm: its output, that output's gradient and the input's, and the fp32
    gradients of its backward."""
    normalized = 0 if saves.liger_llm else (FP32 if t.offset_norms else ACTIVATION_BYTES)
    return LayerWork("final_norm", t.hidden, Size(),
                     Size(tokens=rms_norm_kept(t.hidden, offset=t.offset_norms,
                                               fused=saves.liger_llm)),
                     Size(tokens=ACTIVATION_BYTES * t.hidden),
                     transient_bytes=Size(tokens=3 * ACTIVATION_BYTES * t.hidden
                                          + rms_norm_backward(t.hidden)),
                     weight_only_bytes=Size(tokens=normalized * t.hidden))


def trainer_layer_work(names: list[str], config: ModelConfig,
                       saves: Saves = Saves()) -> list[LayerWork]:
    """Per trainer layer ``names`` (in pipeline order) its analytic work, each analytic layer
    given to exactly one of them. The token embedding holds its table (taken off the
    projector's parameters), the final norm its weight (off the head's); both pass the hidden
    states on with no FLOPs counted. Raises ConfigError when the names do not cover the analytic
    layers once each. ``saves``: as ``layer_work``'s."""
    work = layer_work(config, saves)
    index = {w.name: i for i, w in enumerate(work)}
    moved = {"embed_tokens": ("projector_merge",
                              _token_embedding_work(config.llm, config.tokens_per_tile)),
             "final_norm": ("head", _final_norm_work(config.llm, saves))}
    out, used = [], []
    for name in names:
        if name in NO_LAYER_WORK:
            out.append(moved[name][1])
            continue
        row = index.get(TRAINER_NAMES.get(name, name))
        if row is None:
            raise ConfigError(f"layer {name!r} has no counterpart in the analytic model of "
                              f"{config.name} ({', '.join(index)})")
        used.append(row)
        out.append(work[row])
    if sorted(used) != list(range(len(work))):
        raise ConfigError(f"the layers {', '.join(names)} do not cover {config.name}'s analytic "
                          f"layers once each ({', '.join(index)})")
    analytic = [TRAINER_NAMES.get(n, n) for n in names]
    for name in NO_LAYER_WORK:
        if name in names:
            holder, own = moved[name]
            i = analytic.index(holder)
            held, kept = out[i].activation_bytes, own.activation_bytes
            out[i] = replace(out[i], params=out[i].params - own.params,
                             tied_params=out[i].tied_params - own.tied_params,
                             activation_bytes=Size(held.tiles - kept.tiles,
                                                   held.tokens - kept.tokens))
    return out


def sequence_parallel_refusal(llm: LLMConfig, sp: int) -> str | None:
    """Why Ulysses sequence parallelism of degree ``sp`` cannot split this LLM, or None: it
    splits the query heads over the ranks, and the key/value heads (each repeated to ``sp``
    where fewer, so ``sp`` must then be a multiple of them); a linear-attention layer's state
    runs along the sequence."""
    if sp == 1:
        return None
    if llm.linear_layers:
        return "its linear-attention layers carry a state along the sequence"
    if llm.heads % sp or (llm.kv_heads % sp and sp % llm.kv_heads):
        return (f"its {llm.heads} query and {llm.kv_heads} key/value heads do not split over "
                f"{sp} ranks (SP must divide the query heads, and divide the key/value heads or "
                f"be a multiple of them)")
    return None


def sequence_parallel_bytes(config: ModelConfig) -> float:
    """Bytes one rank sends per token of its shard in a training step of Ulysses sequence
    parallelism, before the (s − 1)/s that stays home: each LLM layer's token mixer re-shards
    its q, k, v (from sequence to heads) and its output (back) in the forward, and their
    gradients in the backward, in bf16. Attention moves its query and key/value heads; a
    linear-attention layer its key and value heads likewise."""
    t = config.llm
    per_layer = []
    for layer in range(t.layers):
        if t.is_linear(layer):
            per_layer.append(2 * t.linear_key_heads * t.linear_key_dim
                             + 2 * t.linear_value_heads * t.linear_value_dim)
        else:
            per_layer.append((2 * t.heads + 2 * t.kv_heads) * t.head_size)
    return 2 * ACTIVATION_BYTES * float(sum(per_layer))


def executed_flops(flops: Size, mode: str) -> Size:
    """Forward + backward FLOPs of a layer of forward ``flops`` run in ``mode``
    (``vlmshard.recipe``): the forward alone for a frozen prefix, the input's gradient beside
    it for a frozen layer after a trained one, the whole backward for a trained layer."""
    return Size(*(flops_factor(mode, k) * getattr(flops, k) for k in SIZE_FIELDS))


def kept_bytes(work: LayerWork, mode: str) -> Size:
    """The activation bytes a layer keeps for backward in ``mode`` (``vlmshard.recipe``), per
    unit of ``Size``: none in a frozen prefix; with its weights frozen, less what only their
    gradients read; under LoRA that, plus what the adapters keep."""
    if mode == "forward":
        return Size()
    if mode == "train":
        return work.activation_bytes
    frozen = work.activation_bytes + work.weight_only_bytes.scaled(-1)
    return frozen + work.adapter_kept_bytes if mode == "lora" else frozen


def held_transient(work: LayerWork, mode: str, size: Size) -> float:
    """The transient bytes of a layer in ``mode`` at a micro-batch of ``size``: its
    ``LayerWork.transient``; a frozen prefix, which keeps nothing, holds its forward's tensors
    for a moment instead, at most what it would keep trained."""
    return work.transient(size) + (work.activation_bytes.dot(size) if mode == "forward" else 0)


def layer_training_flops(work: LayerWork, mode: str) -> Size:
    """Forward + backward FLOPs of a layer in ``mode`` (``executed_flops``), its LoRA adapters'
    trained beside it."""
    return executed_flops(work.flops, mode) + work.adapter_flops.scaled(3)


def lora_adapter_params(t: LLMConfig, layer: int, lora: Lora) -> int:
    """The parameters of LoRA's adapters on decoder layer ``layer``: rank × (in + out) for each
    targeted linear layer (``recipe.LORA_TARGETS``) the layer has, shaped as its
    ``transformers`` module is: attention's projections (Qwen3.5's q_proj also makes its output
    gate), a dense MLP's or a MoE layer's shared expert's; not a linear-attention token mixer
    nor routed experts."""
    return lora.rank * sum(i + o for i, o in _lora_shapes(t, layer, lora))


def _lora_shapes(t: LLMConfig, layer: int, lora: Lora) -> list[tuple[int, int]]:
    """(in, out) of each linear layer of decoder layer ``layer`` LoRA adapts."""
    q, kv = t.heads * t.head_size, t.kv_heads * t.head_size
    shapes = {}
    if not t.is_linear(layer):
        shapes.update(q_proj=(t.hidden, q * (2 if t.attention_gate else 1)),
                      k_proj=(t.hidden, kv), v_proj=(t.hidden, kv), o_proj=(q, t.hidden))
    mlp = t.shared_expert_intermediate if t.is_moe(layer) else t.intermediate
    if mlp:
        shapes.update(gate_proj=(t.hidden, mlp), up_proj=(t.hidden, mlp),
                      down_proj=(mlp, t.hidden))
    return [shape for name, shape in shapes.items() if name in lora.targets]


def lora_selective_bytes(t: LLMConfig, layer: int, lora: Lora) -> float:
    """Per token, what LoRA's adapters on decoder layer ``layer`` keep under selective
    recompute: each adapter's two matmul outputs (A's, rank wide; B's, as wide as the layer's
    output)."""
    return ACTIVATION_BYTES * sum(lora.rank + out for _, out in _lora_shapes(t, layer, lora))


def lora_kept_bytes(t: LLMConfig, layer: int, lora: Lora) -> float:
    """Per token, what LoRA's adapters on decoder layer ``layer`` keep with its weights frozen:
    each adapter's input (a targeted layer's input, which the frozen layer no longer keeps:
    the projections' input, a gated attention's output, the MLP's input and down's) and its
    rank-wide hidden (B's input)."""
    a = ACTIVATION_BYTES
    targets = set(lora.targets)
    linear, moe = t.is_linear(layer), t.is_moe(layer)
    mlp = t.shared_expert_intermediate if moe else t.intermediate
    named = {} if linear else {"q_proj": "attn_in", "k_proj": "attn_in", "v_proj": "attn_in",
                               "o_proj": "o_in"}
    if mlp:
        named.update(gate_proj="mlp_in", up_proj="mlp_in", down_proj="down_in")
    inputs = {named[n] for n in targets if n in named}
    width = {"attn_in": t.hidden, "mlp_in": t.hidden * (not moe), "down_in": mlp,
             "o_in": t.heads * t.head_size * t.attention_gate}
    return a * sum(width[i] for i in inputs) + a * lora.rank * len(_lora_shapes(t, layer, lora))


def with_adapters(work: list[LayerWork], config: ModelConfig, lora: Lora | None
                  ) -> list[LayerWork]:
    """``work`` with LoRA's adapters on each LLM decoder block (none without ``lora``): their
    parameters and their forward FLOPs, a multiply-add per parameter per token."""
    if lora is None:
        return work
    out = []
    for w in work:
        if w.name.startswith("llm_block_"):
            layer = int(w.name.rsplit("_", 1)[1])
            n = lora_adapter_params(config.llm, layer, lora)
            # selectively recomputed, an adapter keeps its two matmuls' outputs too
            selective = None if w.selective_bytes is None else w.selective_bytes + Size(
                tokens=lora_selective_bytes(config.llm, layer, lora))
            w = replace(w, adapter_params=n, adapter_flops=Size(tokens=2 * n),
                        adapter_kept_bytes=Size(tokens=lora_kept_bytes(config.llm, layer, lora)),
                        selective_bytes=selective)
        out.append(w)
    return out


def training_flops(config: ModelConfig, recipe: Recipe = Recipe()) -> Size:
    """Forward + backward FLOPs of the whole model per unit of each ``Size``, each layer as
    ``recipe`` runs it (a frozen ViT at the front: its forward alone; LoRA's adapters beside
    their frozen weights): per tile, per token and per squared length the packer's default
    cost model (``a_v``, ``a_t``, ``b``)."""
    modes = recipe.modes(config.layer_names(), tied=config.llm.tied_embeddings)
    work = with_adapters(layer_work(config), config, recipe.lora)
    return sum((layer_training_flops(lay, mode) for lay, mode in zip(work, modes)), Size())


def weight_bytes_per_param(precision: str = "bf16", dp: int = 1, zero: int = 1) -> float:
    """Device bytes per frozen parameter: its weight alone, in the run's dtype (no gradient, no
    master copy, no moments); ZeRO-3 splits it over the ``dp`` ranks as it splits every
    weight."""
    width = ACTIVATION_BYTES if precision == "bf16" else FP32
    return width / dp if zero == 3 else float(width)
