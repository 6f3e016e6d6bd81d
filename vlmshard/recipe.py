"""What a fine-tuning run trains: which parts of the model (``--train``), and whether the token
embedding stays frozen (``--freeze-embeddings``).

The recipes users run freeze parts (LLaMA-Factory's ``freeze_vision_tower``, Qwen's
``--tune_mm_vision False``, InternVL's ``freeze_backbone``), and a frozen part changes the work
each pipeline layer executes. In pipeline order, a layer runs in one of three modes:

- ``forward``: frozen, with no trainable layer before it. Forward only, under ``no_grad``: it
  keeps no activations and has no backward.
- ``input_grad``: frozen, after a trainable layer. Forward, then the gradient of its input for
  the layers before it, but none for its own weights.
- ``train``: forward and backward, its weights' gradients included.

The trainer, the cost model and the partition search all read the modes from here, so the
FLOPs they count are the work that runs (``flops_factor``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from .config import option
from .errors import ConfigError

Part = Literal["vit", "projector", "llm"]
PARTS: tuple[str, ...] = get_args(Part)
Mode = Literal["forward", "input_grad", "train"]


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
class Recipe:
    """The parts a run trains; the rest of the model's weights stay as loaded."""

    train: tuple[str, ...] = PARTS
    freeze_embeddings: bool = False

    def __post_init__(self) -> None:
        unknown = [p for p in self.train if p not in PARTS]
        if unknown:
            raise ConfigError(f"--train: {', '.join(map(repr, unknown))} is no part of a model; "
                              f"name any of {', '.join(PARTS)}")
        if not self.train:
            raise ConfigError(f"--train names nothing to train; name any of {', '.join(PARTS)}")

    @property
    def full(self) -> bool:
        """Every weight trains: the recipe of a full fine-tune."""
        return set(self.train) == set(PARTS) and not self.freeze_embeddings

    def trains(self, layer: str, tied_to_head: bool = False) -> bool:
        """Whether pipeline layer ``layer``'s weights train. The token embedding is frozen with
        ``freeze_embeddings``, and so is a head that shares its weight (``tied_to_head``: the
        model ties them, as ``tie_word_embeddings`` says)."""
        if part_of(layer) not in self.train:
            return False
        embedding = layer == "embed_tokens" or (layer == "head" and tied_to_head)
        return not (embedding and self.freeze_embeddings)

    def modes(self, layers: list[str], tied: bool = False) -> list[str]:
        """Per layer of ``layers`` (pipeline order), the mode it runs in (the module's
        docstring). ``tied``: the token embedding and the head share one weight. Raises
        ConfigError when nothing trains."""
        trains = [self.trains(name, tied) for name in layers]
        if not any(trains):
            raise ConfigError(f"--train {','.join(self.train)}"
                              + (" with --freeze-embeddings" if self.freeze_embeddings else "")
                              + " leaves no weight of the model to train")
        first = trains.index(True)
        return ["train" if t else "forward" if i < first else "input_grad"
                for i, t in enumerate(trains)]

    def describe(self) -> str:
        """The recipe as a user reads it: ``vit,projector,llm`` or ``projector,llm (embeddings
        frozen)``."""
        return ",".join(p for p in PARTS if p in self.train) + (
            " (embeddings frozen)" if self.freeze_embeddings else "")

    @classmethod
    def from_params(cls, params: dict) -> "Recipe":
        """The recipe a plan was packed for, from its ``params`` (every part, in a plan of a
        vlmshard that trained them all)."""
        return cls(tuple(params.get("train", PARTS)), params.get("freeze_embeddings", False))



# Per ``Size`` field, what a mode's forward + backward costs in forwards. A weight's matmul has a
# backward of two such matmuls (its input's gradient and its weight's), so ``train`` is 3 × the
# forward and ``input_grad`` 2 ×. Attention's score and value products have no weight: their
# backward is twice their forward whether the layer's weights train or not.
ATTENTION_FIELDS = ("squares", "windowed", "vit_squares", "vit_windows")


def flops_factor(mode: str, field: str) -> float:
    """Forward + backward FLOPs over forward FLOPs of a layer in ``mode``, for the work of its
    ``Size`` ``field`` (``vlmshard.model_sizes.Size``)."""
    if mode == "forward":
        return 1.0
    if mode == "input_grad" and field not in ATTENTION_FIELDS:
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

    def __post_init__(self) -> None:
        self.train = [p for item in self.train for p in str(item).split(",") if p]
        self.recipe  # checks the parts

    @property
    def recipe(self) -> Recipe:
        return Recipe(tuple(dict.fromkeys(self.train)), self.freeze_embeddings)
