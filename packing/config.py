"""Options of ``vlmshard pack``: one definition each (flag, YAML key, type, help)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from vlmshard.config import ConfigError, option
from vlmshard.families import families, presets
from vlmshard.recipe import RecipeOptions

from .cost import ComputeMode
from .groups import GroupOrder, parse_groups

Algorithm = Literal["balanced", "isf", "lengthgroup", "random"]
ALGORITHMS: tuple[str, ...] = get_args(Algorithm)
PADDED = ("random", "lengthgroup")  # micro-batches padded per sample, not packed
SEARCHED_CAPS = ("searched: balanced's for the best step_efficiency under --max-qv/--max-qt, "
                 "isf's by OmniBal's search")


# each family's ViT unit, as its stats count it (its default preset's)
_UNITS = "; ".join(f"{f.presets[f.default_preset].vision.image_size} px for {f.description}"
                   for f in families().values())


@dataclass(kw_only=True)
class PackConfig(RecipeOptions):
    """Options of ``vlmshard pack``."""

    stats: str = option(help="preprocess output folder, a stats .parquet, or OmniBal "
                             "length/meta .json")
    dp: int = option(help="data-parallel ranks")
    out: str = option(help="plan folder to write")
    micro_batches: int = option(1, help="micro-batches per rank per step")
    virtual_ranks: int | None = option(
        None, help="plan for this many ranks, a multiple of --dp: shards then serve any real DP "
                   "size dividing it", default_text="--dp")
    algo: Algorithm = option("balanced", help="packing algorithm")
    qv: int | None = option(None, help="ViT tiles per micro-batch (with --qt)",
                            default_text=SEARCHED_CAPS)
    qt: int | None = option(None, help="LLM tokens per micro-batch (with --qv)",
                            default_text=SEARCHED_CAPS)
    max_qv: int | None = option(
        None, help="memory bound: the most ViT tiles a micro-batch may hold; balanced's "
                   "automatic caps are searched below it (e.g. the caps of the packer you "
                   "compare with, or what the device's memory holds)",
        default_text="the --cost-model file's max_qv (vlmshard train profile's memory model); "
                     "else --target-samples mean samples' tiles, at least the largest sample's")
    max_qt: int | None = option(
        None, help="memory bound: the most LLM tokens a micro-batch may hold (with --max-qv)",
        default_text="the --cost-model file's max_qt; else --target-samples mean samples' "
                     "tokens, at least the largest sample's")
    target_samples: int = option(4, help="samples per micro-batch: for random and lengthgroup "
                                         "exactly; for isf the mean its caps search aims at; for "
                                         "balanced the default memory bound")
    max_unplaced_ratio: float = option(
        0.01, help="the share of the samples a plan may leave out for exceeding a cap (over "
                   "--qv/--qt, the memory bound, or the largest group; an image or video over "
                   "one rank's tiles); past it pack writes no plan and names the caps to raise "
                   "(samples that fill no whole last step are not counted)")
    compute_mode: ComputeMode = option(
        "padding-free", help="what the trainer computes on, for step_efficiency: padding-free "
                             "(vlmshard train: real tiles and tokens only) or padded (linear "
                             "layers on all Qv tiles and Qt tokens of each micro-batch)")
    groups: str | None = option(
        None, help="packing groups with sequence parallelism (Hierarchical Balance Packing): "
                   "'auto' (levels and SP degrees chosen for the best step_efficiency, the SP "
                   "exchange counted) or lengths LENGTH[:SP],... shortest first (e.g. "
                   "8192,32768:4); each group's micro-batch holds LENGTH tokens over SP ranks "
                   "(default SP: the fewest ranks whose --max-qt holds it), and its Qv is SP "
                   "ranks' --max-qv; --max-qv/--max-qt then bound one rank; a sample goes to "
                   "the smallest group that holds it; balanced only",
        metavar="auto|LENGTH[:SP],...", default_text="one group: the caps")
    group_order: GroupOrder = option(
        "mixed", help="the order of the groups' steps in an epoch: mixed (each group's steps "
                      "spread evenly over it) or short-first (HBP's curriculum)")
    seed: int = option(0, help="shuffle seed; epoch e uses seed + e")
    epochs: int = option(1, help="epochs to plan")
    cost_model: str | None = option(
        None, help="measured costs: a cost_model.json with a_v, a_t, b, or a `vlmshard train "
                   "profile` folder holding one, or a training run's folder (a_v, a_t, b and "
                   "a_s refit from its train_log.jsonl's step times)",
        metavar="FILE|DIR", default_text="the FLOPs of --model")
    model: str | None = option(
        None, help=f"model whose FLOPs set the default cost model: a Hugging Face model folder "
                   f"(its config.json's sizes) or a preset ({', '.join(presets())}); its ViT unit "
                   f"must be the stats' ({_UNITS})",
        default_text="the model folder the stats were preprocessed for; else the family's "
                     f"preset ({', '.join(f.default_preset for f in families().values())})")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.cost_model and not self.recipe.full:
            raise ConfigError("--train/--freeze-embeddings set the default cost model's FLOPs; "
                              "--cost-model gives measured ones (a profile of the recipe): "
                              "give one or the other")
        for name in ("dp", "micro_batches", "epochs", "target_samples"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be at least 1, "
                                  f"got {getattr(self, name)}")
        if not 0 <= self.max_unplaced_ratio <= 1:
            raise ConfigError(f"--max-unplaced-ratio must be between 0 and 1, got "
                              f"{self.max_unplaced_ratio}")
        if self.virtual_ranks is not None and (self.virtual_ranks < 1
                                               or self.virtual_ranks % self.dp):
            raise ConfigError(f"--virtual-ranks {self.virtual_ranks} must be a multiple of "
                              f"--dp {self.dp}")
        if (self.qv is None) != (self.qt is None):
            raise ConfigError("give both --qv and --qt, or neither (then they are chosen)")
        if self.qv is not None and (self.max_qv is not None or self.max_qt is not None):
            raise ConfigError("--qv/--qt fix the caps; --max-qv/--max-qt bound their search: "
                              "give one pair or the other")
        if (self.max_qv or 0) < 0 or (self.max_qt is not None and self.max_qt < 1):
            raise ConfigError(f"the memory bound must be positive, got --max-qv {self.max_qv} "
                              f"--max-qt {self.max_qt}")
        if self.groups is not None:
            spec = parse_groups(self.groups)
            if self.algo != "balanced" or self.qv is not None:
                raise ConfigError("--groups packs with --algo balanced and sets each group's "
                                  "caps: drop --algo/--qv/--qt (--max-qv/--max-qt bound one rank)")
            for length, sp in spec or []:
                if sp is not None and self.dp % sp:
                    raise ConfigError(f"--groups: group {length}:{sp}'s SP degree {sp} does not "
                                      f"divide --dp {self.dp}")
        if self.qv is not None:
            if self.algo in PADDED:
                raise ConfigError(f"--qv/--qt do not apply to {self.algo}: it takes "
                                  f"--target-samples samples per micro-batch")
            if self.qv < 0 or self.qt < 1:
                raise ConfigError(f"caps must be positive, got --qv {self.qv} --qt {self.qt}")

    @property
    def ranks(self) -> int:
        return self.virtual_ranks or self.dp
