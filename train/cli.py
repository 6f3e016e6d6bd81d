"""``vlmshard train`` and ``vlmshard train profile``: launch ``train.trainer`` on local processes
through DeepSpeed's launcher, or profile the layers and search the stage partition."""

from __future__ import annotations

import argparse
import os

from vlmshard.config import add_options, load_config

from .config import ProfileConfig, TrainConfig

DESCRIPTION = """\
Fine-tunes a Hugging Face model folder (InternVL, Qwen2-VL, Qwen2.5-VL; --model, by default the
folder the shards were preprocessed with) through DeepSpeed's pipeline engine: each stage builds
and loads only its own layers of the transformers model, and computes on the real tiles and
tokens only. Starts PP x DP processes with the DeepSpeed launcher (gloo on CPU, nccl on GPU). Each
data-parallel replica streams its rank's shards (shards planned for V virtual ranks serve any DP
dividing V); the pipeline takes one packed micro-batch per record, the plan's micro-batches of a
step are its gradient accumulation, and the loss is normalized per supervised token over the
global batch (Ave-Token). Writes OUT/train_log.jsonl: per step the loss, step time, tokens/s,
every rank's forward, backward and waiting time, and the plan steps and sample ids each DP rank
trained on; DeepSpeed checkpoints go to OUT/checkpoints/step-N (--resume continues exactly), each
with an HF folder (hf/), and the final weights to OUT/hf (from_pretrained loads them).

`vlmshard train profile --help` shows the profiling command."""

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


def add_arguments(p: argparse.ArgumentParser) -> None:
    # `train profile` is a subcommand only when it comes first: `vlmshard train profile ...`.
    sub = p.add_subparsers(dest="action", metavar="[profile]")
    profile = sub.add_parser("profile", help="profile layers, calibrate the cost model, search "
                                             "the partition", description=PROFILE_DESCRIPTION,
                             formatter_class=argparse.RawDescriptionHelpFormatter)
    add_options(profile, ProfileConfig)
    add_options(p, TrainConfig)


def main(args: argparse.Namespace) -> int:
    action = args.__dict__.pop("action", None)
    if hasattr(args, "resume") and not hasattr(args, "out"):
        args.out = args.resume  # continue in the folder being resumed
    if action == "profile":
        return _profile(args)
    try:
        cfg = load_config(TrainConfig, args)
        cfg.validate()
        cfg.resolve_partition()
        cfg.model = cfg.model_path()
    except (ValueError, OSError, KeyError) as e:
        raise SystemExit(f"vlmshard train: error: {e}") from None
    from .launcher import launch

    status = launch(cfg)
    if status:
        raise SystemExit(f"vlmshard train: the training processes exited with status {status}")
    print(f"trained -> {os.path.join(cfg.out, 'train_log.jsonl')}")
    return 0


def _profile(args: argparse.Namespace) -> int:
    from vlmshard.partition import PartitionError
    from .profile import run_profile

    try:
        cfg = load_config(ProfileConfig, args)
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
