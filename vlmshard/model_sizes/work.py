"""The units of cost: the terms of a micro-batch every cost is linear in (``CostTerms``), and what
one pipeline layer costs per unit of them (``LayerWork``), or one half of an LLM layer
(``Mixer``)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields, replace

from .configs import VisionConfig
from .memory import LOSS_CHUNK


@dataclass(frozen=True)
class CostTerms:
    """The sizes of a micro-batch (or a sum of them) that every cost is linear in: tiles,
    tokens, the LLM's attention, for a ViT attending across whole images (Qwen's) its
    attention (``vit_attention_size``), and the supervised tokens, the rows the LM head makes
    logits for (``vlmshard.train``'s ``lm_loss``). A producer that cannot know the supervised
    count passes its tokens, the most there can be."""

    tiles: float = 0.0
    tokens: float = 0.0
    squares: float = 0.0  # Σ seq_len² over packed samples
    # Σ m·(2·seq_len − m), m = min(seq_len, window): a causal sliding-window layer's pairs in
    # the units where full causal attention's are seq_len² (= seq_len² up to the window)
    windowed: float = 0.0
    vit_squares: float = 0.0  # Σ P² over images and videos' temporal steps of P patches
    vit_windows: float = 0.0  # Σ P² over the ViT's windows of P patches (Qwen2.5-VL)
    supervised: float = 0.0  # tokens with a next-token target: the LM head's rows

    def dot(self, other: "CostTerms") -> float:
        return sum(getattr(self, k) * getattr(other, k) for k in TERM_FIELDS)

    def __add__(self, other: "CostTerms") -> "CostTerms":
        return CostTerms(*(getattr(self, k) + getattr(other, k) for k in TERM_FIELDS))

    def scaled(self, factor: float) -> "CostTerms":
        return CostTerms(*(factor * getattr(self, k) for k in TERM_FIELDS))

    def windows_as_full(self) -> "CostTerms":
        """These FLOPs with sliding-window layers charged as full attention: for sizes that
        know only Σseq_len² (the simulator's, the default partition's), exact for samples no
        longer than the window and an upper bound beyond."""
        return replace(self, squares=self.squares + self.windowed, windowed=0.0)


TERM_FIELDS = tuple(f.name for f in fields(CostTerms))


def vit_attention_size(vision: VisionConfig, grids: Iterable[Sequence[int]]) -> CostTerms:
    """The attention sizes of images and videos of ViT patch ``grids`` (t, h, w) for a ViT that
    attends across each image and each temporal step of a video (``VisionConfig.fused_qkv``:
    Qwen's, as ``transformers.vision_utils.get_vision_cu_seqlens`` splits them): Σ P² over
    temporal steps of P = h·w patches; with windows (Qwen2.5-VL, ``get_vision_window_index``)
    Σ P² over each step's windows of ``window`` × ``window`` tiles, the last row and column of
    windows cut at the image's edge. A ViT that attends within a tile has its attention in the
    per-tile FLOPs: empty."""
    if not vision.fused_qkv:
        return CostTerms()
    merge = vision.image_size // vision.patch_size  # a tile: merge × merge patches
    full = windows = 0
    for t, h, w in grids:
        full += t * (h * w) ** 2
        if vision.window:
            rows, cols = (_cut(side // merge, vision.window) for side in (h, w))
            windows += t * merge ** 4 * sum(r * r for r in rows) * sum(c * c for c in cols)
    return CostTerms(vit_squares=full, vit_windows=windows)


def _cut(length: int, window: int) -> list[int]:
    """``length`` in pieces of ``window``, the last one shorter."""
    return [window] * (length // window) + ([length % window] if length % window else [])


@dataclass(frozen=True)
class Mixer:
    """Half of an LLM layer (its token or its channel mixer): parameters, forward FLOPs per unit
    of ``CostTerms``, the bytes it keeps for backward per token, and the widest gradients its
    backward holds at once per token."""

    params: float
    flops: CostTerms
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
    """One pipeline layer: parameters, and per unit of each of ``CostTerms`` its forward FLOPs,
    the activation bytes it keeps for backward and the bytes of the activation it hands to the
    next layer."""

    name: str
    params: int
    flops: CostTerms
    activation_bytes: CostTerms
    output_bytes: CostTerms
    # what its forward + backward hold at once beyond what it keeps and its parameters'
    # gradients (counted with the parameters): its output and that output's gradient, its
    # input's gradient, the widest gradients inside it; and per row of the loss's chunk (the
    # head: its fp32 logits, made the gradient in place, and below fp32 their cast), up to
    # ``LOSS_CHUNK`` rows
    transient_bytes: CostTerms = CostTerms()
    chunk_row_bytes: float = 0.0
    # held whatever the micro-batch's size: the token embedding's fp32 table gradient, the LM
    # loss's fp32 block of the gradient it scales
    fixed_transient_bytes: float = 0.0
    # kept under selective recompute besides the layer's input: its matmuls' and attention
    # kernels' outputs (``vlmshard.train.recompute``); None where a layer has no such mode
    selective_bytes: CostTerms | None = None
    # of ``params``, the table a tied LM head and the token embedding share
    # (``LLMConfig.tied_embeddings``): a stage holding both layers holds it once
    tied_params: int = 0
    # of ``activation_bytes``, what only the weights' gradients read (linear layers' inputs, a
    # norm's normalized values): not kept with the weights frozen (``kept_bytes``)
    weight_only_bytes: CostTerms = CostTerms()
    # LoRA's adapters on the layer (``with_adapters``): trained while ``params`` stay frozen,
    # their forward FLOPs per unit of ``CostTerms``, and what they keep (their linear layers'
    # inputs again, and each adapter's rank-wide hidden)
    adapter_params: int = 0
    adapter_flops: CostTerms = CostTerms()
    adapter_kept_bytes: CostTerms = CostTerms()
    # its input is data (the pixels), which needs no gradient: its backward computes its
    # weights' gradients alone, one forward's FLOPs less (``modes.layer_training_flops``)
    input_is_data: bool = False
    # its forward computes its backward's gradients too (the LM head's fused loss, which keeps
    # them for a backward that only scales them): its training FLOPs all run in the forward
    gradients_in_forward: bool = False

    def transient(self, size: CostTerms) -> float:
        """The transient bytes at a micro-batch of ``size``."""
        return (self.transient_bytes.dot(size) + self.chunk_row_bytes * min(size.tokens, LOSS_CHUNK)
                + self.fixed_transient_bytes)
