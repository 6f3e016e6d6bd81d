"""What activations cost: the dtypes' widths, where the trainer's kernels keep other tensors than
``transformers``' modules and in what dtype (``Saves``), and the bytes a norm or a gated MLP
keeps for backward, which every layer kind's builder adds up. ``a`` is the width of one element
of an activation in the run's dtype (``Saves.element_bytes``)."""

from __future__ import annotations

from dataclasses import dataclass

ACTIVATION_BYTES = 2  # bf16: what a GPU rank trains in, the default ``Saves.element_bytes``
FP32 = 4
INT64 = 8  # an index: token ids, gathered rows, targets
LOSS_CHUNK = 1024  # rows of logits the LM loss makes at a time (vlmshard.train's lm_loss)
# elements of a low-precision gradient the LM loss's backward scales in fp32 at a time
LOSS_SCALE_BLOCK = 2**25
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
    activation between them); ``liger_projector``: Liger's RMSNorm in the projector's norm of
    each patch (Qwen2-VL's and Qwen2.5-VL's merger), which Liger takes wherever it is on, the
    ViT's blocks compiled or not. ``kv_repeated``: the LLM's attention kernel is given K/V heads
    repeated to the query heads (torch's varlen kernel before 2.12 takes no grouped-query
    heads), and keeps them so. Compiled blocks are counted as their eager modules.
    ``element_bytes``: the width of an element of the run's dtype, bf16's 2 (a GPU rank's) or
    fp32's 4 (a CPU run's default); tensors in the run's dtype scale with it, while fp32 upcasts
    and statistics, and int64 indices, keep their widths. ``sp``: the Ulysses degree of the
    rank's sequence-parallel group (``vlmshard.train.sequence_parallel``; sizes are then one
    rank's share): its attention kernel keeps the K/V heads repeated to ``sp`` where fewer
    (``kv_kernel_heads``), and its token embedding exchanges the media rows (``media_exchange``).
    """

    vit_one_call: bool = False
    liger_llm: bool = False
    liger_vit: bool = False
    liger_projector: bool = False
    kv_repeated: bool = False
    element_bytes: int = ACTIVATION_BYTES
    sp: int = 1


def kv_kernel_heads(kv_heads: int, saves: Saves) -> int:
    """The K/V heads per token an LLM attention kernel keeps, and whose gradients its backward
    makes: a sequence-parallel rank's exchange repeats them to ``sp`` where fewer, so that each
    of the ``sp`` ranks gets one (``Exchange.heads_to_sequence``): per token of its share
    max(kv_heads, sp) of them."""
    return max(kv_heads, saves.sp)


def rms_norm_kept(width: float, a: int, rows: float = 1, offset: bool = False,
                  fused: bool = False) -> float:
    """Bytes a ``transformers`` RMSNorm of ``width`` keeps per token (``rows`` norms a token):
    its input upcast to fp32, 1/rms per row, and the normalized values the weight multiplies,
    in the run's dtype, or in fp32 for a (1 + weight) norm (``LLMConfig.offset_norms``).
    ``fused``: Liger's kernel, which keeps the input as it came and 1/rms in fp32. What reads
    its output keeps that apart."""
    if fused:
        return a * width + FP32 * rows
    return FP32 * width + FP32 * rows + (FP32 if offset else a) * width


def normalized_kept(width: float, a: int, offset: bool = False, fused: bool = False) -> float:
    """Of what an RMSNorm keeps per token, the normalized values only its weight's gradient
    reads (Liger's kernel keeps none: it recomputes them)."""
    return 0.0 if fused else (FP32 if offset else a) * width


def pre_norm_kept(width: float, a: int, offset: bool = False, fused: bool = False) -> float:
    """Bytes an LLM mixer's pre-norm keeps per token, and its output, which the mixer's first
    projections keep as their input."""
    return rms_norm_kept(width, a, offset=offset, fused=fused) + a * width


def gated_mlp_kept(intermediate: float, a: int, fused: bool = False) -> float:
    """Bytes a gated MLP keeps per token beyond its input: the gate and up projections' outputs,
    the activation of the gate (not with Liger's fused kernel, ``fused``) and the product the
    down projection reads."""
    return (3 if fused else 4) * a * intermediate


def rms_norm_backward(width: float) -> float:
    """Bytes an RMSNorm's backward holds per token beyond what the norm keeps: the fp32
    gradients of its chain of ops (input, square, mean, normalized values, weight product)."""
    return 5 * FP32 * width


def layer_norm_kept(width: float, a: int) -> float:
    """Bytes a LayerNorm keeps per row: its input, and the mean and 1/std in fp32 (a GPU's;
    torch's CPU kernel keeps them in the input's dtype)."""
    return a * width + 2 * FP32
