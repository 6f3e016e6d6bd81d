"""The cost model of ``docs/design.md``: what one micro-batch costs on each resource.

``vit_cost = a_v·Σtiles + a_vs·Σunit_tiles²``, ``llm_cost = a_t·Σseq_len + b·Σseq_len² +
a_s·Σsupervised``. A Qwen ViT attends across each image and video step (its units:
``Lengths.unit_squares``), a windowed block within whole windows (charged in ``a_v``: exact where
an image's sides are whole windows, above it otherwise). Packed samples attend only within
themselves; the LM head makes logits for supervised tokens (``loss_tokens``) only. Only
attention layers make the ``b`` term; a ``window_share`` of it within a sliding ``window`` w
(Gemma 3's local layers) costs w·(2·seq_len − w) past the window: ``squares`` gives each
sample's quadratic work in units of ``b``, which the packer, its metrics and report use.
Defaults are the model's training FLOPs (forward + backward = 3× forward) from its layer sizes
(``vlmshard/model_sizes``: a model folder's ``config.json`` or a preset); ``vlmshard train
profile`` writes a measured ``cost_model.json``, and a training run's folder is refit from its
own log (``CostModel.from_run``): both by ``fit_coefficients``.

A step of sequence-parallel degree s splits each micro-batch's work over s ranks and pays the
exchange Ulysses makes: ``c_sp·Σseq_len·(s − 1)/s`` per micro-batch, in the same FLOP units
(the bytes ``model_sizes.sequence_parallel_bytes`` counts, priced at the reference card's FLOPs
per byte of its link, ``vlmshard.hardware``). A profile's ``cost_model.json`` may state ``c_sp``;
without it, communication is not priced.
"""

from __future__ import annotations

import logging
import os
from dataclasses import asdict, dataclass, replace
from typing import Literal, get_args

import numpy as np

from vlmshard.errors import ConfigError, InputError
from vlmshard.io import file_in, read_json
from vlmshard.recipe import Recipe
from vlmshard.run_log import LOG_NAME, PIPELINE_NAME, read_log

log = logging.getLogger(__name__)

# What the trainer computes on: ``padding-free`` (vlmshard train: every layer on the real tiles
# and tokens only), or ``padded`` (linear layers on all Qv tiles and Qt tokens of every
# micro-batch, attention within the real samples, as a trainer that keeps the static shapes).
ComputeMode = Literal["padding-free", "padded"]
COMPUTE_MODES: tuple[str, ...] = get_args(ComputeMode)


@dataclass(frozen=True)
class CostModel:
    a_v: float  # per ViT tile
    a_t: float  # per LLM token
    b: float  # per squared sequence length of one packed sample
    origin: str  # where the numbers came from: a model name or a cost_model.json
    window: int = 0  # the sliding window of the layers that have one (0: none)
    window_share: float = 0.0  # the share of ``b`` those layers make
    c_sp: float = 0.0  # per token, the sequence-parallel exchange at (s − 1)/s = 1
    # per token and key/value head sent beyond the model's ``kv_heads``: an SP degree above them
    # repeats each to s heads before the exchange
    c_sp_head: float = 0.0
    kv_heads: int = 0
    # per supervised token: the LM head, whose logits exist only for supervised rows (0 in a
    # profile's fitted cost_model.json, whose a_t holds the head's time)
    a_s: float = 0.0
    # what the run trains (``vlmshard.recipe``), and a_v over the a_v of training every part:
    # a frozen ViT's forward alone is about a third of its training work
    recipe: str = "vit,projector,llm"
    a_v_share: float = 1.0
    # a model refit from a run's log (``from_run``): the rows it was fitted over and its error
    fit: dict | None = None
    # per tile² of a ViT unit: the attention of a ViT across each image and video step (Qwen's)
    a_vs: float = 0.0

    @classmethod
    def from_sizes(cls, model, recipe: Recipe = Recipe()) -> "CostModel":
        """Training FLOPs of a ``vlmshard.model_sizes.ModelConfig``, from its layer sizes, each
        layer as ``recipe`` runs it."""
        from vlmshard.hardware import GPUS, REFERENCE_GPU, flops_per_sp_byte
        from vlmshard.model_sizes import sequence_parallel_bytes, training_flops

        flops = training_flops(model, recipe)
        full = training_flops(model)
        b = flops.squares + flops.windowed
        # ``vit_attention_size``'s Σ P² of P = tiles·merge² patches per unit, and per tile a
        # whole window's (window² tiles') P² over its tiles
        per_tile = model.patches_per_tile ** 2 * model.vision.window ** 2
        price, kv = flops_per_sp_byte(GPUS[REFERENCE_GPU]), model.llm.kv_heads
        c_sp = sequence_parallel_bytes(model) * price
        a_v, full_a_v = (f.tiles + f.vit_windows * per_tile for f in (flops, full))
        return cls(a_v, flops.tokens, b, f"flops:{model.name}",
                   window=model.llm.sliding_window if flops.windowed else 0,
                   window_share=flops.windowed / b if flops.windowed else 0.0,
                   c_sp=c_sp, kv_heads=kv,
                   c_sp_head=sequence_parallel_bytes(model, kv + 1) * price - c_sp,
                   a_s=flops.supervised, recipe=recipe.describe(),
                   a_v_share=a_v / full_a_v if full_a_v else 1.0,
                   a_vs=flops.vit_squares * model.patches_per_tile ** 2)

    @classmethod
    def for_stats(cls, name: str | None, family: str, model_folder: str | None = None,
                  unit_px: int | None = None, recipe: Recipe = Recipe()) -> "CostModel":
        """The FLOPs of ``model_for_stats``, trained as ``recipe`` says."""
        return cls.from_sizes(model_for_stats(name, family, model_folder, unit_px), recipe)

    @classmethod
    def from_json(cls, path: str) -> "CostModel":
        data = read_json(path)
        try:
            a_v, a_t, b = (float(data[k]) for k in ("a_v", "a_t", "b"))
        except (KeyError, TypeError, ValueError) as e:
            raise InputError(f"{path}: a cost model needs numbers a_v, a_t and b") from e
        if min(a_v, a_t, b) < 0 or a_v + a_t + b <= 0:
            raise InputError(f"{path}: cost coefficients must be non-negative and not all zero")
        try:
            window, share = int(data.get("window", 0)), float(data.get("window_share", 0.0))
            c_sp = float(data.get("c_sp", 0.0))
        except (TypeError, ValueError) as e:
            raise InputError(f"{path}: window must be a whole number of tokens, window_share "
                             "and c_sp numbers") from e
        if window < 0 or not 0.0 <= share <= 1.0 or c_sp < 0:
            raise InputError(f"{path}: window must be >= 0, window_share within [0, 1] and "
                             "c_sp >= 0")
        try:
            a_s, a_vs = (float(data.get(k, 0.0)) for k in ("a_s", "a_vs"))
        except (TypeError, ValueError) as e:
            raise InputError(f"{path}: a_s and a_vs must be numbers") from e
        if min(a_s, a_vs) < 0:
            raise InputError(f"{path}: a_s and a_vs must be >= 0")
        return cls(a_v, a_t, b, f"file:{path}", window=window, window_share=share, c_sp=c_sp,
                   a_s=a_s, a_vs=a_vs)

    @classmethod
    def from_run(cls, folder: str) -> "CostModel":
        """Refit from a training run's folder: its ``train_log.jsonl``'s sizes and part times
        per step and data-parallel rank (``run_rows``) by ``fit_coefficients``, ``b`` per unit
        of quadratic work under the sliding window of the model its ``pipeline.json`` names."""
        from vlmshard.model_sizes import ModelConfig

        path = os.path.join(folder, LOG_NAME)
        model = ModelConfig.from_dict(
            read_json(file_in(folder, PIPELINE_NAME, "--cost-model"))["model"])
        window = cls.from_sizes(model)
        try:
            rows = run_rows(read_log(path))
            if len(rows) < 3:
                raise InputError(f"{path}: {len(rows)} step(s) x data-parallel ranks after the "
                                 "warm-up step: too few to fit a_v, a_t and b (train more steps)")
            refit = cls(**fit_coefficients(rows, window.window_share, model.patches_per_tile),
                        origin=f"run:{folder}",
                        window=window.window, window_share=window.window_share)
            refit = replace(refit, fit=fit_error(refit, rows, model.patches_per_tile))
        except KeyError as e:
            raise InputError(f"{path} lacks {e}: a run of an older vlmshard") from e
        if refit.a_v + refit.a_t + refit.b <= 0:
            raise InputError(f"{path}: its times fit no positive cost (a_v, a_t, b all 0)")
        return refit

    def cost(self, tiles, tokens, squares, supervised=None, unit_squares=0.0):
        """Cost of micro-batches (or ranks) from their Σtiles, Σtokens, Σ``squares``,
        Σsupervised tokens (None: their tokens, the most there can be) and Σ tiles² over their
        ViT units (``Lengths.unit_squares``)."""
        supervised = tokens if supervised is None else supervised
        return (self.a_v * tiles + self.a_vs * unit_squares + self.a_t * tokens
                + self.b * squares + self.a_s * supervised)

    def sp_exchange(self, tokens, sp: int):
        """What sequence parallelism of degree ``sp`` adds to micro-batches (or ranks) of
        Σ``tokens``, in the cost's units: the exchange, ``c_sp·tokens·(sp − 1)/sp``, its
        key/value heads repeated to ``sp`` where fewer."""
        repeated = self.c_sp_head * max(0, sp - self.kv_heads)
        return (self.c_sp + repeated) * tokens * (sp - 1) / sp

    def squares(self, tokens: np.ndarray) -> np.ndarray:
        """Per sample of ``tokens`` its quadratic work in units of ``b``: seq_len², less what
        the sliding-window layers skip past their window: causal attention within a window w
        is w·(2·len − w) in the units where full causal attention is len² (both twice the
        query-key pairs), len² − (len − w)². float64."""
        t = np.asarray(tokens, dtype=np.float64)
        if not self.window or not self.window_share:
            return t * t
        return t * t - self.window_share * np.maximum(t - self.window, 0.0) ** 2

    def to_dict(self) -> dict:
        return asdict(self)


def model_for_stats(name: str | None, family: str, model_folder: str | None = None,
                    unit_px: int | None = None):
    """The sizes (``model_sizes.ModelConfig``) of ``name`` (a model folder or a preset;
    default: the folder the stats were made for, else the family's preset), checked to count
    the ViT in the unit the stats do (``unit_px``, the recorded tiling's; else the family
    preset's): a model of other units would weigh tiles against tokens wrongly."""
    import os

    from vlmshard.families import family as family_named
    from vlmshard.families import presets

    preset = family_named(family).default_preset
    if not name and model_folder and not os.path.isdir(model_folder):
        log.warning("the stats' model folder %s is not here; costing with the %s preset",
                    model_folder, preset)
        model_folder = None
    name = name or model_folder or preset
    known = presets()
    model = _model_sizes(name, known)
    unit = unit_px or known[preset].vision.image_size
    if model.vision.image_size != unit:
        raise ConfigError(f"model {name!r} counts {model.vision.image_size}-px ViT units, but "
                          f"the stats count {family}'s {unit}-px units: pass the model "
                          f"folder the stats were made for, a preset of {unit}-px units "
                          f"or a --cost-model file")
    return model


def _model_sizes(name: str, presets: dict):
    """A preset's sizes, or those a model folder's ``config.json`` states."""
    import os

    from vlmshard.families import model_sizes

    if name in presets:
        return presets[name]
    config = os.path.join(name, "config.json")
    if not os.path.isfile(config):
        raise ConfigError(f"unknown model {name!r}: neither a preset "
                          f"({', '.join(sorted(presets))}) nor a model folder with a config.json")
    try:
        return model_sizes(read_json(config), name)
    except ValueError as e:  # sizes this model's config.json does not allow
        raise InputError(f"{config}: {e}") from e


def read_cost_model(path: str) -> CostModel:
    """``--cost-model`` as ``resolve_cost_model`` resolved it: a run's folder refit, else a
    ``cost_model.json``."""
    return CostModel.from_run(path) if os.path.isdir(path) else CostModel.from_json(path)


def resolve_cost_model(path: str) -> str:
    """What ``--cost-model`` names: a training run's folder (one holding ``train_log.jsonl``)
    as it is, a profile's folder's ``cost_model.json``, or the file given."""
    if os.path.isfile(os.path.join(path, LOG_NAME)):
        return path
    return file_in(path, "cost_model.json", "--cost-model")


def cost_model_file(path: str) -> dict:
    """The fields of a resolved ``--cost-model`` file (a profile's memory caps among them); a
    run's folder states none."""
    return {} if os.path.isdir(path) else read_json(path)


# A run's parts as a profile splits its layers: the ViT's time holds the projector's (per-tile
# layers), the LLM's the rest but the LM head, timed apart for a_s
_RUN_PARTS = {"vit_s": ("vit", "projector"), "llm_s": ("llm",), "head_s": ("head",)}
_RUN_SIZES = ("tiles", "tokens", "squares", "supervised", "windowed", "vit_squares")


def run_rows(records: list[dict]) -> list[dict]:
    """Per logged step and data-parallel rank: the sizes its first stage trained (Σ over its
    micro-batches) and its stages' seconds per part (``_RUN_PARTS``), for ``fit_coefficients``.
    Left out: the first step (warm-up), a traced one (the profiler's overhead) and
    sequence-parallel ones (their times hold the exchange, which is not fitted)."""
    rows = []
    for record in records[1:]:
        if record.get("traced") or record.get("sp", 1) > 1:
            continue
        for data in record["data"]:
            ranks = [r["time_breakdown"] for r in record["ranks"]
                     if r["dp_rank"] == data["dp_rank"]]
            row = {k: sum(m[k] for m in data["micro_sizes"]) for k in _RUN_SIZES
                   if k in data["micro_sizes"][0]}
            row.update({k: sum(r[p] for r in ranks for p in parts)
                        for k, parts in _RUN_PARTS.items()})
            rows.append(row)
    return rows


def fit_coefficients(rows: list[dict], window_share: float = 0.0,
                     patches_per_tile: int | None = None) -> dict:
    """``a_v``, ``a_t``, ``b`` in seconds, by non-negative least squares over rows of measured
    sizes (``tiles``, ``tokens``, ``squares``, a sliding window's ``windowed``) and seconds (the
    ViT's ``vit_s``, the LLM's ``llm_s``): ``b`` per unit of quadratic work as
    ``CostModel.squares`` counts it (``window_share`` of it within the window). Where the rows
    time the LM head apart (``head_s``), ``a_s`` per ``supervised`` token too; else ``llm_s``
    holds the head. For a ViT attending across its units (``patches_per_tile`` given) whose
    rows log their Σ P² (``vit_squares``, P patches a unit), ``a_vs`` per unit tile² too,
    where the rows tell it apart from ``a_v``."""
    vit = _column(rows, "tiles")[:, None]
    if patches_per_tile and any(r.get("vit_squares") for r in rows):
        both = np.c_[vit, _column(rows, "vit_squares") / patches_per_tile ** 2]
        # rows whose tiles and tile² are in one proportion (ranks given equal media) cannot
        # tell the two apart: a_v alone then holds the attention
        across = np.linalg.matrix_rank(both / both.max(axis=0).clip(min=1.0)) == 2
        vit = both if across else vit
    a_v, *a_vs = _nnls(vit, _column(rows, "vit_s"))
    a_t, b = _nnls(np.stack([_column(rows, "tokens"), _quadratic(rows, window_share)], axis=1),
                   _column(rows, "llm_s"))
    fitted = {"a_v": a_v, "a_t": a_t, "b": b, **({"a_vs": a_vs[0]} if a_vs else {})}
    if "head_s" in rows[0]:
        (fitted["a_s"],) = _nnls(_column(rows, "supervised")[:, None], _column(rows, "head_s"))
    return fitted


def _column(rows: list[dict], key: str) -> np.ndarray:
    """``key`` of each row; the ViT's ``vit_squares`` 0 where not logged (a ViT within tiles)."""
    return np.array([r.get(key, 0.0) if key == "vit_squares" else r[key] for r in rows],
                    dtype=float)


def _quadratic(rows: list[dict], window_share: float) -> np.ndarray:
    """Each row's quadratic work in units of ``b``: its squares, less ``window_share`` of what
    a sliding window skips (``windowed``: those layers' work within it)."""
    squares = _column(rows, "squares")
    windowed = np.array([r.get("windowed", r["squares"]) for r in rows], dtype=float)
    return squares - window_share * (squares - windowed)


def _nnls(x: np.ndarray, y: np.ndarray) -> list[float]:
    """Non-negative least squares of ``y`` on the columns of ``x``, each scaled to at most 1
    first: tokens and squares differ by 1e4, which ill-conditions the solve."""
    from scipy.optimize import nnls

    scale = x.max(axis=0).clip(min=1.0)
    coefficients, _ = nnls(x / scale, y)
    return [float(c) for c in coefficients / scale]


def fit_error(cost: CostModel, rows: list[dict], patches_per_tile: int) -> dict:
    """How well ``cost`` times ``run_rows`` (of a model of ``patches_per_tile``): their count and
    the root-mean-square error of each row's predicted compute over the mean measured."""
    measured = sum(_column(rows, k) for k in _RUN_PARTS)
    error = cost.cost(_column(rows, "tiles"), _column(rows, "tokens"),
                      _quadratic(rows, cost.window_share), _column(rows, "supervised"),
                      _column(rows, "vit_squares") / patches_per_tile ** 2) - measured
    return {"rows": len(rows), "rms_error": float(np.sqrt(np.mean(error ** 2)) / measured.mean())}
