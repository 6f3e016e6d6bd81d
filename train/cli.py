"""``vlmshard train`` and ``vlmshard train profile``: launch ``vlmshard.train.trainer`` on local
processes through DeepSpeed's launcher, or profile the layers and search the stage partition."""

from __future__ import annotations

import argparse

from vlmshard.stage import add_stage_arguments, resolve, run_command

from .config import ProfileConfig, TrainConfig

DESCRIPTION = """\
Fine-tunes a Hugging Face model folder of a registered family (--model lists the model types;
by default the folder the shards were preprocessed with) through DeepSpeed's pipeline engine:
each stage builds and loads only its own layers of the transformers model, and computes on the
real tiles and tokens only. The stage partition and per-stage recompute: --partition (the
profile's), else --bounds, else the exact search over the model's analytic FLOPs and memory at
the shards' micro-batch sizes and the device's memory (the log and OUT/pipeline.json say which
ran and why). AdamW at --lr with Hugging Face's warm-up and schedule (cosine by default).
Starts PP x DP processes with the DeepSpeed launcher (gloo on CPU, nccl on GPU). Each
data-parallel replica streams its rank's shards (shards planned for V virtual ranks serve any DP
dividing V); the pipeline takes one packed micro-batch per record, the plan's micro-batches of a
step are its gradient accumulation, and the loss is normalized per supervised token over the
global batch (Ave-Token). Writes OUT/train_log.jsonl: per step the loss, step time, tokens/s,
every rank's forward, backward and waiting time, and the plan steps and sample ids each DP rank
trained on; DeepSpeed checkpoints go to OUT/checkpoints/step-N (--resume continues exactly), each
with an HF folder (hf/), and the final weights to OUT/hf (from_pretrained loads them). --train
names the parts that train (the rest frozen, costed and partitioned as they run); --lora-rank
trains the LLM through PEFT's LoRA adapters and writes PEFT's adapter folder (adapter/) instead,
and with --merge also hf/ with the adapters folded in.

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
    add_stage_arguments(profile, ProfileConfig)
    add_stage_arguments(p, TrainConfig)


def continue_in_resumed(args: argparse.Namespace) -> None:
    """``--resume RUN`` without ``--out`` continues in RUN."""
    if hasattr(args, "resume") and not hasattr(args, "out"):
        args.out = args.resume


def main(args: argparse.Namespace) -> int:
    action = args.__dict__.pop("action", None)
    continue_in_resumed(args)
    if action == "profile":
        return run_command("train profile", ProfileConfig,
                           resolve("vlmshard.train.profile:run_profile"), args)
    return run_command("train", TrainConfig, resolve("vlmshard.train.launcher:run_train"), args)
