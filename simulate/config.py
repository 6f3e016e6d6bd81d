"""Options of ``vlmshard simulate``: one definition each (flag, YAML key, type, help)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from vlmshard.config import ConfigError, option
from vlmshard.hardware import SUSTAINED_SHARE
from vlmshard.families import presets
from vlmshard.packing.cost import ComputeMode

from .cost_error import CostError

ModelName = Literal[tuple(presets())]  # type: ignore[valid-type]


@dataclass(kw_only=True)
class SimulateConfig:
    """Options of ``vlmshard simulate``."""

    plan: str | None = option(None, positional=True, metavar="PLAN_DIR", help="plan folder")
    model: ModelName = option("internvl-chat-1.5", help="model preset")
    gpu: Literal["a100", "h100", "h100-pcie", "h200", "b200", "l40s"] = option(
        "a100", help="GPU kind (dense bf16 peak, memory, links: vlmshard.hardware)")
    pp: int = option(4, help="pipeline stages")
    dp: int | None = option(None, help="data-parallel replicas; must divide the plan's ranks",
                            default_text="the plan's ranks")
    micro_batches: int | None = option(None, help="micro-batches per replica per step",
                                       default_text="the plan's")
    mfu: float = option(SUSTAINED_SHARE, help="sustained fraction of peak FLOPs")
    compute_mode: ComputeMode | None = option(
        None, help="what the simulated trainer computes on: padding-free (real tiles and tokens "
                   "only, as vlmshard train) or padded (linear layers on all Qv tiles and Qt "
                   "tokens of every micro-batch, attention within the real samples; each "
                   "packing at its own caps)",
        default_text="the plan's, as vlmshard pack --compute-mode recorded it")
    zero: int = option(1, help="ZeRO stage 0 or 1 (DeepSpeed pipelines support no more)")
    grad_accum: Literal["fp32", "bf16"] = option(
        "fp32", help="gradient accumulation dtype, as `vlmshard train --grad-accum` (bf16: 4 "
                     "bytes per parameter less)")
    compare: bool = option(True, help="also simulate the packing strategies and OmniBal's "
                                      "levers (--no-compare: only the plan itself)")
    cost_error: CostError = option(
        factory=CostError, cli=False,
        help="{noise, vit, llm, seed}: time every strategy at true costs that depart from the "
             "cost model the plans were packed with (simulate/cost_error.py): each sample's ViT "
             "and LLM work times a seeded factor uniform in 1 ± noise, then every ViT part times "
             "1 + vit and every LLM part times 1 + llm; padding-free compute only")
    train_log: str | None = option(None, help="train_log.jsonl of a run to check the simulator "
                                              "against (with --profile)")
    profile: str | None = option(None, help="the run's `vlmshard train profile` folder")
    out_json: str | None = option(None, metavar="PATH",
                                  help="also write the results as JSON to PATH (--json prints "
                                       "them instead of the tables)")

    def __post_init__(self) -> None:
        if self.pp < 1 or (self.dp is not None and self.dp < 1):
            raise ConfigError("--pp and --dp must be at least 1")
        if not 0 < self.mfu <= 1:
            raise ConfigError(f"--mfu must be in (0, 1], got {self.mfu}")
        if self.zero not in (0, 1):
            raise ConfigError("--zero must be 0 or 1 (DeepSpeed pipelines support no more)")
        if bool(self.train_log) != bool(self.profile):
            raise ConfigError("--train-log needs --profile (the measured layer times), and back")
        if not self.plan and not self.train_log:
            raise ConfigError("give a PLAN_DIR, or --train-log and --profile to validate")
