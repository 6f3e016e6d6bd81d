"""What a fine-tuning run trains: which parts of the model (``--train``), whether the token
embedding stays frozen (``--freeze-embeddings``), and whether the LLM trains through LoRA
adapters (``--lora-rank``).

The recipes users run freeze parts (LLaMA-Factory's ``freeze_vision_tower``, Qwen's
``--tune_mm_vision False``, InternVL's ``freeze_backbone``), and a frozen part changes the work
each pipeline layer executes. In pipeline order, a layer runs in one of four modes:

- ``forward``: frozen, with no trainable layer before it. Forward only, under ``no_grad``: it
  keeps no activations and has no backward.
- ``input_grad``: frozen, after a trainable layer. Forward, then the gradient of its input for
  the layers before it, but none for its own weights.
- ``train``: forward and backward, its weights' gradients included.
- ``lora``: an LLM decoder block under LoRA: its weights frozen (their input's gradient only),
  its adapters trained.

The trainer, the cost model and the partition search all read the modes from here, so the
FLOPs they count are the work that runs (``flops_factor``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Literal, get_args

from .config import option
from .errors import ConfigError

Part = Literal["vit", "projector", "llm"]
PARTS: tuple[str, ...] = get_args(Part)
Mode = Literal["forward", "input_grad", "train", "lora"]
# The linear layers of a decoder block LoRA can adapt, by their module names in the
# ``transformers`` models of every family (attention's projections, a dense MLP's and a shared
# expert's): LLaMA-Factory's ``lora_target: all`` for these blocks. A MoE block's routed
# experts (fused weights, no linear layer) and a linear-attention block's token mixer are not.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def part_of(layer: str) -> str:
    """The part (``PARTS``) a pipeline layer belongs to, by its name: the ViT's embedding and
    blocks (with the DeepStack mergers inside them, as LLaMA-Factory counts Qwen3-VL's
    ``deepstack_merger_list`` in the vision tower), the projector (the analytic model's
    ``projector_merge``), and the LLM from its token embedding to its head."""
    if layer.startswith("vit_"):
        return "vit"
    if layer.startswith("projector"):
        return "projector"
    return "llm"


@dataclass(frozen=True)
class Lora:
    """LoRA adapters on the LLM's decoder blocks, as PEFT's ``LoraConfig`` states them: each
    targeted linear layer's frozen weight W gains ``alpha / rank`` · B·A, B initialized to zero
    (A as PEFT initializes it, from ``seed``)."""

    rank: int
    alpha: float
    dropout: float = 0.0
    targets: tuple[str, ...] = LORA_TARGETS
    seed: int = 0

    def __post_init__(self) -> None:
        if self.rank < 1 or self.alpha <= 0 or not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"LoRA needs --lora-rank >= 1, --lora-alpha > 0 and --lora-dropout "
                              f"in [0, 1); got {self.rank}, {self.alpha}, {self.dropout}")
        unknown = [t for t in self.targets if t not in LORA_TARGETS]
        if unknown or not self.targets:
            raise ConfigError(f"--lora-targets: {', '.join(map(repr, unknown)) or 'none'} "
                              f"match no linear layer LoRA adapts; name any of "
                              f"{', '.join(LORA_TARGETS)}")


@dataclass(frozen=True)
class Recipe:
    """The parts a run trains (through LoRA adapters for the LLM, with ``lora``); the rest of
    the model's weights stay as loaded."""

    train: tuple[str, ...] = PARTS
    freeze_embeddings: bool = False
    lora: Lora | None = None

    def __post_init__(self) -> None:
        unknown = [p for p in self.train if p not in PARTS]
        if unknown:
            raise ConfigError(f"--train: {', '.join(map(repr, unknown))} is no part of a model; "
                              f"name any of {', '.join(PARTS)}")
        if not self.train:
            raise ConfigError(f"--train names nothing to train; name any of {', '.join(PARTS)}")
        if self.lora and "llm" not in self.train:
            raise ConfigError(f"--lora-rank adapts the LLM, which --train {' '.join(self.train)} "
                              "leaves frozen: add llm to --train")

    @property
    def full(self) -> bool:
        """Every weight trains: the recipe of a full fine-tune."""
        return set(self.train) == set(PARTS) and not self.freeze_embeddings and not self.lora

    def mode_of(self, layer: str, tied_to_head: bool = False) -> Mode | None:
        """How pipeline layer ``layer`` trains: ``train``, ``lora`` or None (frozen). The token
        embedding is frozen with ``freeze_embeddings``, and so is a head that shares its weight
        (``tied_to_head``: the model ties them, as ``tie_word_embeddings`` says); under LoRA the
        LLM's decoder blocks take adapters and its other layers stay frozen."""
        if part_of(layer) not in self.train:
            return None
        if self.lora and part_of(layer) == "llm":
            return "lora" if layer.startswith("llm_block_") else None
        embedding = layer == "embed_tokens" or (layer == "head" and tied_to_head)
        return None if embedding and self.freeze_embeddings else "train"

    def modes(self, layers: list[str], tied: bool = False) -> list[Mode]:
        """Per layer of ``layers`` (pipeline order), the mode it runs in (the module's
        docstring). ``tied``: the token embedding and the head share one weight. Raises
        ConfigError when nothing trains."""
        trains = [self.mode_of(name, tied) for name in layers]
        if not any(trains):
            raise ConfigError(f"--train {','.join(self.train)}"
                              + (" with --freeze-embeddings" if self.freeze_embeddings else "")
                              + " leaves no weight of the model to train")
        first = next(i for i, t in enumerate(trains) if t)
        return [t or ("forward" if i < first else "input_grad") for i, t in enumerate(trains)]

    def describe(self) -> str:
        """The recipe as a user reads it: ``vit,projector,llm``, ``projector,llm (embeddings
        frozen)`` or ``llm (LoRA rank 8)``."""
        return ",".join(p for p in PARTS if p in self.train) + (
            " (embeddings frozen)" if self.freeze_embeddings else "") + (
            f" (LoRA rank {self.lora.rank})" if self.lora else "")

    @classmethod
    def from_params(cls, params: dict) -> "Recipe":
        """The recipe a plan was packed for, from its ``params`` (every part, in a plan of a
        vlmshard that trained them all)."""
        return RecipeOptions(**{f.name: params[f.name] for f in fields(RecipeOptions)
                                if f.name in params}).recipe



# The modes whose layer has weights that train (LoRA's adapters among them)
TRAINED_MODES = ("train", "lora")


def input_needs_grad(modes: list[Mode], index: int) -> bool:
    """Whether layer ``index`` of layers run in ``modes`` needs its input's gradient: a layer
    before it trains. Where none does, a stage starting there takes its input detached and
    sends no gradient back."""
    return any(mode in TRAINED_MODES for mode in modes[:index])


# Per ``CostTerms`` field, what a mode's forward + backward costs in forwards. A weight's matmul
# has a backward of two such matmuls (its input's gradient and its weight's), so ``train`` is
# 3 × the forward and ``input_grad`` 2 ×. Attention's score and value products have no weight: their
# backward is twice their forward whether the layer's weights train or not.
ATTENTION_FIELDS = ("squares", "windowed", "vit_squares", "vit_windows")


def flops_factor(mode: Mode, field: str) -> float:
    """Forward + backward FLOPs over forward FLOPs of a layer in ``mode``, for the work of its
    ``CostTerms`` ``field`` (``vlmshard.model_sizes.CostTerms``)."""
    if mode == "forward":
        return 1.0
    if mode in ("input_grad", "lora") and field not in ATTENTION_FIELDS:
        return 2.0
    return 3.0


@dataclass(kw_only=True)
class RecipeOptions:
    """The options that say what a run trains: ``train`` and ``pack`` (its cost model) share
    them."""

    train: list[str] = option(
        factory=lambda: list(PARTS), metavar="PART",
        help="the parts of the model whose weights train: vit (the vision tower), projector "
             "(InternVL's MLP, Qwen's merger), llm (token embedding to LM head), any of them, "
             "space- or comma-separated; the rest stay frozen: a frozen part runs forward "
             "only (or also its input's gradient, after a trained part), keeps no gradients or "
             "optimizer states, and is costed so. LLaMA-Factory's freeze_vision_tower and "
             "Qwen's --tune_mm_vision False are --train projector llm",
        default_text="vit projector llm")
    freeze_embeddings: bool = option(
        False, help="keep the LLM's token embedding frozen (and an LM head tied to it, as "
                    "tie_word_embeddings makes it)")
    lora_rank: int = option(
        0, help="train the LLM through LoRA adapters of this rank on its decoder blocks' linear "
                "layers (--lora-targets), through PEFT: their weights, the embedding, final "
                "norm and head frozen; the run saves a PEFT adapter folder (OUT/adapter) that "
                "peft.PeftModel.from_pretrained loads on the transformers model. 0: no LoRA")
    lora_alpha: float | None = option(
        None, help="LoRA's scale numerator: an adapter adds alpha / rank x B·A",
        default_text="2 x --lora-rank, as LLaMA-Factory")
    lora_dropout: float = option(0.0, help="dropout on a LoRA adapter's input (PEFT's)")
    lora_targets: list[str] = option(
        factory=lambda: list(LORA_TARGETS), metavar="MODULE",
        help="the decoder blocks' linear layers that take adapters, by module name, space- or "
             "comma-separated", default_text=" ".join(LORA_TARGETS))

    def __post_init__(self) -> None:
        self.train = [p for item in self.train for p in str(item).split(",") if p]
        self.lora_targets = [t for item in self.lora_targets for t in str(item).split(",") if t]
        if self.lora_rank < 0:
            raise ConfigError(f"--lora-rank must be at least 0, got {self.lora_rank}")
        if not self.lora_rank and self.lora_alpha is not None:
            raise ConfigError("--lora-alpha scales LoRA adapters: give --lora-rank too")
        self.recipe  # checks the parts and the adapters

    @property
    def recipe(self) -> Recipe:
        lora = Lora(self.lora_rank, self.lora_alpha or 2.0 * self.lora_rank, self.lora_dropout,
                    tuple(dict.fromkeys(self.lora_targets))) if self.lora_rank else None
        return Recipe(tuple(dict.fromkeys(self.train)), self.freeze_embeddings, lora)
