"""Model sizes and what each pipeline layer costs, computed from them: torch-free, read by
packing (its default cost model), train (model shapes, FLOPs per step) and simulate.

The sizes of a model come from its family (``vlmshard.families``): those a model folder's
``config.json`` states, with the features the family knows its layers have (``LLMFeatures``),
or one of the family's named presets. A model's ViT unit (``image_size``) must be the one its
family's stats count (a 448-px tile, a 28-px or 32-px merged patch, a whole image), and one tile
must make exactly the ``tokens_per_tile`` image tokens the shards were tokenized with. An LLM's
FLOPs count what a token runs through: for a MoE layer its router and its ``experts_per_token``
experts, while its memory holds all of them.

Every layer cost is linear in the terms of a micro-batch (``CostTerms``); the packer balances
three of them: Σtiles, Σtokens and Σseq_len² (packed samples attend only within themselves; a
linear-attention layer costs linear in tokens). A Qwen ViT attends across each image, so its
blocks' FLOPs also follow Σ P² over images of P patches, which the trainer's MFU and the replay
count and the packer leaves out (``vit_attention_size``). ``vlmshard train profile`` measures
the same quantities on a device; this is its analytic twin. Conventions: a multiply-add is 2
FLOPs (backward is 2x forward); activations are in the run's dtype (``Saves.element_bytes``:
bf16 unless a run says otherwise) with memory-efficient attention (no score matrix), kept as
``transformers``' modules save them; parameters cost what the trainer's engine
holds per parameter (``bytes_per_param``). Each layer kind has its builder module (``vit``,
``deepstack``, ``projector``, ``attention``, ``linear_attention``, ``mlp``, ``moe``, ``head``),
``layers`` puts them in pipeline order, and ``modes`` and ``lora`` cost them as a recipe runs.
"""

from .configs import PROJECTOR_KINDS, LLMConfig, LLMFeatures, ModelConfig, VisionConfig
from .layers import (
    NO_LAYER_WORK,
    TRAINER_NAMES,
    layer_work,
    sequence_parallel_bytes,
    sequence_parallel_refusal,
    trainer_layer_work,
)
from .lora import lora_adapter_params, lora_kept_bytes, lora_selective_bytes, with_adapters
from .memory import (
    ACTIVATION_BYTES,
    CHECKPOINT_STATE_BYTES,
    FP32,
    INT64,
    LOSS_CHUNK,
    LOSS_SCALE_BLOCK,
    Saves,
    gated_mlp_kept,
    layer_norm_kept,
    rms_norm_backward,
    rms_norm_kept,
)
from .modes import (
    executed_flops,
    forward_flops,
    held_transient,
    kept_bytes,
    layer_training_flops,
    training_flops,
)
from .param_bytes import (
    ZERO3_MAX_REUSE_DISTANCE,
    ZERO3_PERSISTENCE_THRESHOLD,
    ZERO3_PREFETCH_BUCKET,
    ZERO3_REDUCE_BUCKET,
    Zero3Weights,
    bytes_per_param,
    weight_bytes_per_param,
    zero3_fixed_bytes,
)
from .projector import (
    PROJECTORS,
    ProjectorWork,
    merger_projector,
    mlp_projector,
    pool_projector,
)
from .work import TERM_FIELDS, LayerWork, Mixer, CostTerms, vit_attention_size

__all__ = [
    "ACTIVATION_BYTES", "CHECKPOINT_STATE_BYTES", "FP32", "INT64", "LOSS_CHUNK", "LOSS_SCALE_BLOCK",
    "NO_LAYER_WORK",
    "PROJECTORS", "PROJECTOR_KINDS", "TERM_FIELDS", "TRAINER_NAMES", "ZERO3_MAX_REUSE_DISTANCE",
    "ZERO3_PERSISTENCE_THRESHOLD", "ZERO3_PREFETCH_BUCKET", "ZERO3_REDUCE_BUCKET", "LLMConfig",
    "LLMFeatures", "LayerWork", "Mixer", "ModelConfig", "ProjectorWork", "Saves", "CostTerms",
    "VisionConfig", "Zero3Weights", "bytes_per_param", "executed_flops", "forward_flops",
    "gated_mlp_kept", "held_transient", "kept_bytes", "layer_norm_kept", "layer_training_flops",
    "layer_work",
    "lora_adapter_params", "lora_kept_bytes", "lora_selective_bytes", "merger_projector",
    "mlp_projector", "pool_projector", "rms_norm_backward", "rms_norm_kept",
    "sequence_parallel_bytes", "sequence_parallel_refusal", "trainer_layer_work",
    "training_flops", "vit_attention_size", "weight_bytes_per_param", "with_adapters",
    "zero3_fixed_bytes",
]
