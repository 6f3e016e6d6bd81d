"""``vlmshard train``: launch ``train.trainer`` on local processes through DeepSpeed's launcher."""

from __future__ import annotations

import argparse
import os

from vlmshard.config import load_config

from .launcher import launch
from .trainer import TrainConfig

HELP = "train the VLM on shards with DeepSpeed's pipeline engine (PP x DP local processes)"
DESCRIPTION = """\
Starts PP x DP processes with the DeepSpeed launcher (gloo on CPU, nccl on GPU). Each
data-parallel replica streams its rank's shards (shards planned for V virtual ranks serve any DP
dividing V); the pipeline takes one packed micro-batch per record, the plan's micro-batches of a
step are its gradient accumulation, and the loss is normalized per supervised token over the
global batch (Ave-Token). Writes OUT/train_log.jsonl: per step the loss, step time, tokens/s,
every rank's forward, backward and waiting time, and the plan steps and sample ids each DP rank
trained on; DeepSpeed checkpoints go to OUT/checkpoints (--resume continues exactly)."""


PROFILE_DESCRIPTION = """\
Runs each pipeline layer alone on real micro-batches from the shards, on this device: forward and
backward time, activation bytes saved for backward, input/output bytes, parameter + optimizer
bytes. Writes OUT/profile.json, OUT/cost_model.json (a_v, a_t, b fitted to the measured times:
`vlmshard pack --cost-model OUT/cost_model.json` balances for this model) and OUT/partition.json:
the exact min-max stage partition for --pp stages with the fewest recomputed layers per stage
that fit --memory-budget (stage s holds PP - s micro-batches under 1F1B), next to DeepSpeed's
'parameters' and 'uniform' partitions and OmniBal's best neighbourhood candidates (ranked by
stage-time variance, then boundary bytes). --validate-top K trains a few real steps with the
search and the K-1 best OmniBal candidates and chooses the fastest measured; otherwise the search
is chosen. `vlmshard train --partition OUT/partition.json` uses the chosen one."""


def _common(p: argparse.ArgumentParser) -> None:
    S = argparse.SUPPRESS
    p.add_argument("--config", help="YAML file with any of these options (flags override it); "
                                    "its 'model' key is a preset name or sizes")
    p.add_argument("--shards", default=S, help="shard folder or URL (required)")
    p.add_argument("--out", default=S, help="output folder (required)")
    p.add_argument("--pp", type=int, default=S, help="pipeline stages (default 1)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    S = argparse.SUPPRESS
    _common(p)
    sub = p.add_subparsers(dest="action", metavar="[profile]")
    prof = sub.add_parser("profile", help="profile layers, calibrate the cost model, search "
                                          "the partition", description=PROFILE_DESCRIPTION,
                          formatter_class=argparse.RawDescriptionHelpFormatter)
    _common(prof)
    prof.add_argument("--memory-budget", dest="memory_budget", default=S,
                      help="memory per pipeline stage, e.g. 80GiB (default)")
    prof.add_argument("--micro-batches", dest="micro_batches", type=int, default=S,
                      help="micro-batches to profile (default 4)")
    prof.add_argument("--device", default=S, help="cpu or cuda (default: cuda if available)")
    prof.add_argument("--validate-top", dest="validate_top", type=int, default=S,
                      help="train real steps with the K best candidates and choose the fastest "
                           "(default 0: choose the search's)")
    prof.add_argument("--validate-steps", dest="validate_steps", type=int, default=S,
                      help="steps per validated candidate, the first untimed (default 4)")
    p.add_argument("--partition", default=S,
                   help="partition.json from 'vlmshard train profile': its searched stage "
                        "bounds and per-stage recompute (default: DeepSpeed's 'parameters')")
    p.add_argument("--dp", type=int, default=S, help="data-parallel replicas (default 1)")
    p.add_argument("--max-steps", dest="max_steps", type=int, default=S,
                   help="optimizer steps (default: one pass over the shards; more repeats them)")
    p.add_argument("--lr", type=float, default=S, help="AdamW learning rate (default 1e-3)")
    p.add_argument("--seed", type=int, default=S, help="model initialization seed")
    p.add_argument("--checkpoint-every", dest="checkpoint_every", type=int, default=S,
                   help="save a DeepSpeed checkpoint every N steps (always after the last)")
    p.add_argument("--resume", default=S,
                   help="run folder to continue from its latest checkpoint: the data position "
                        "follows from the step (default --out: that folder)")


def main(args: argparse.Namespace) -> int:
    flags = {k: v for k, v in vars(args).items() if k not in ("config", "action")}
    if "resume" in flags:
        flags.setdefault("out", flags["resume"])
    if args.action == "profile":
        return _profile(flags, args.config)
    try:
        cfg = load_config(TrainConfig, flags, args.config)
        cfg.validate()
        cfg.resolve_partition()
    except (ValueError, OSError, KeyError) as e:
        raise SystemExit(f"vlmshard train: error: {e}") from None
    status = launch(cfg)
    if status:
        raise SystemExit(f"vlmshard train: the training processes exited with status {status}")
    print(f"trained -> {os.path.join(cfg.out, 'train_log.jsonl')}")
    return 0


def _profile(flags: dict, config_file: str | None) -> int:
    from .partition import PartitionError
    from .profile import ProfileConfig, run_profile

    try:
        cfg = load_config(ProfileConfig, flags, config_file)
        partitions = run_profile(cfg)
    except (ValueError, PartitionError, RuntimeError) as e:
        raise SystemExit(f"vlmshard train profile: error: {e}") from None
    measured = {p["name"]: p["measured_step_s"] for p in partitions.get("validated", [])}
    print(f"{'partition':<11} {'max stage s':>11} {'measured s':>10}  stage times (s) / "
          "recomputed layers")
    rows = [("parameters", partitions["parameters"]), ("uniform", partitions["uniform"]),
            ("search", partitions["search"])] + [(p["name"], p) for p in partitions["omnibal"]]
    for name, p in rows:
        if p is None:
            print(f"{name:<11} {'does not fit':>11}")
            continue
        times = " ".join(f"{s['time_s']:.4f}/{len(s['recompute'])}" for s in p["stages"])
        real = f"{measured[name]:.4f}" if name in measured else "-"
        print(f"{name:<11} {p['max_stage_s']:>11.4f} {real:>10}  {times}   bounds {p['bounds']}")
    print(f"chosen: {partitions['chosen']['name']}")
    print(f"-> {cfg.out}/profile.json, cost_model.json, partition.json")
    return 0
