"""One command for a GPU's first hour: vlmshard's trainer on one device, on a balanced and a
random plan of the same samples, and the figures users judge a trainer by.

    python benchmarks/gpu_bench.py            # on a GPU: Qwen3-VL-2B's sizes, random weights
    python benchmarks/gpu_bench.py --smoke    # the same path on CPU with a tiny model: seconds

The GPU machine needs a CUDA build of torch, DeepSpeed and transformers installed (it has no
network: install them, or carry a virtual environment built for it). Nothing is downloaded.

1. Model: ``--model DIR``, or Qwen3-VL-2B's published sizes (its LLM is Qwen3-1.7B's: 28
   layers of 2048, GQA 16/8, head_dim 128, vocabulary 151,936; a 24-block ViT of 1024 with
   DeepStack from blocks 5, 11, 17; the LM head tied to the token embedding) with random
   weights; ``--untied-head`` gives it an LM head of its own (0.3B more parameters: the
   model of the GPU runs before 2026-11-28); ``--smoke``: the demo's tiny Qwen3-VL, images
   of at most a quarter of its pixels.
2. Data: the demo generator at ``--scale`` (captions, document QA with long answers, multi-image
   and text-only chat), preprocessed for the model; packed ``random`` and ``balanced`` for one
   rank, ``--micro-batches`` a step, each filling what the device holds for it. The memory
   model for the device the bench runs on, with the kernels the trainer runs there, gives the
   largest micro-batch shaped like the mean sample that one stage holds recomputing no layer
   whole (selectively at most: no matmul runs twice, which MFU does not count;
   ``vlmshard.train.capacity``, ``memory_bound.recompute_free``). Balanced packs
   under it (``caps``), as ``vlmshard pack --max-qv --max-qt`` takes what a device holds;
   random takes as many samples a micro-batch as its padded caps (that many of the largest
   sample, ``random_caps``) keep inside it, for any draw of samples must fit.
   ``--target-samples`` sets random's samples instead and packs balanced under random's caps,
   as every run before 2026-11-30 did (those before 2026-11-28 took 4). ``memory_bound`` also
   holds the largest micro-batch with layers recomputed whole where they must: larger
   micro-batches, each with less of the host's fixed cost, for recomputed FLOPs.
3. Each plan trains ``--steps`` steps (PP=1, DP=1, the partition and recompute vlmshard searches
   by default, host syncs counted); the first ``--warmup`` steps are dropped.
4. Then the loader alone: the micro-batches the balanced plan's steps trained, through the
   trainer's loader (its workers, pinned memory, real pixel rows), no model: micro-batches,
   tokens and tiles per second. (After the training: its pinned memory makes a CUDA context in
   this process.)
5. One JSON line and a table: device; torch, CUDA, NCCL, DeepSpeed, transformers versions;
   attention backend; median and p90 step time; real tokens/s and tiles/s; MFU (the step's
   model FLOPs over step time × the device's dense bf16 peak, from ``vlmshard.hardware`` or
   ``--peak-tflops``; ``vit_attention_share`` of those FLOPs a Qwen ViT's attention across each
   image, which a count linear in tiles leaves out; the LLM's causal attention counted as the
   half square it computes, and in ``mfu_full_attention`` as the full square, the convention
   of Megatron-LM's, torchtitan's and llm-foundry's published MFU); peak memory
   (``max_memory_allocated``) beside the memory model's for the steps' largest micro-batches
   and at the caps; loader throughput; host syncs per step; and the simulator's predicted step
   time beside the measured, with each step's relative error (``replay_step_error``): the run
   replayed with the analytic FLOPs at the FLOP rate ``vlmshard train profile`` measured per
   layer kind on the balanced shards
   (``sustained_flops_per_s``; over the peak, ``sustained_share``); HFU (MFU's FLOPs plus those
   recompute runs again: ``train_log.recompute_flops``); and the time breakdown: seconds per
   step by part (ViT, projector, LLM, head + loss, recompute, optimizer, pipeline wait, data
   wait, other), from the trainer's CUDA events, summing to the step with its loading
   (``breakdown_step_s``). ``--trace DIR`` also writes a torch profiler trace of each plan's
   second step, and each run reports its summary (``trace``: device time by kernel class, the
   top kernels, the device's busy time against its span, and what the host ran while the
   device sat idle: ``device_idle_host``) and where the host waited (``host_sync_sites``).
6. ``--baseline``: the balanced shards' steps (the same samples in the same order) trained by
   Hugging Face's ``Trainer`` (examples/hf_trainer.py) with vlmshard's optimizer, schedule,
   clipping and precision: ``hf_packed`` on ``shards.model_inputs`` (packed, each sample
   attending to itself alone, as LLaMA-Factory's packing trains) and ``hf_padded`` with each
   step's samples in random micro-batches of about equal padded tokens, padded per sample (the
   common default), as many a step as keep each within a packed micro-batch's tokens; their
   tokens/s, MFU (the same steps' model FLOPs) and loss per step. Each peer trains without
   gradient checkpointing where the device holds it; else, packed, each micro-batch cut in two
   and accumulated (``split``); else with checkpointing (``gradient_checkpointing``),
   with Liger's kernels where Liger is installed on a GPU (``liger``), vlmshard's rank's
   intra-op threads (``threads``) and patch embedding (``patch_linear``); a peer that runs out
   of memory even so is reported so (``error``), and the bench goes on.
7. ``--ab NAME ...``: the balanced plan trained again with one switch flipped, beside the run
   with the defaults: ``compiled`` (regional ``torch.compile`` of the ViT's and the LLM's
   blocks), ``compiled_vit`` (the ViT's only), ``frozen_vit`` (``--train projector llm``: the
   vision tower frozen, the recipe users run; with ``--baseline`` the peers train it too, as
   ``hf_packed_frozen_vit``, ...), ``compiled_frozen_vit`` (both: the peers do not train that
   recipe again), ``cudnn_vit`` (a Qwen ViT on SDPA, a call per
   run of equal-sized images, cuDNN's kernel first), ``compiled_cudnn_vit`` (both), ``cudnn``
   (every layer on SDPA, cuDNN's kernel first: the LLM's samples too), ``no_liger`` (Liger's
   kernels off), ``no_vit_varlen`` (the ViT's attention once per image), ``conv_patch`` (the
   patch embedding as ``transformers``' Conv3d), ``full_recompute`` (every LLM block recomputed
   whole, not selectively); each as ``balanced_NAME``, or, where its training fails on the
   device (a compiler's error), that error (``error``) and the bench goes on. ``--quick``: the
   balanced plan alone (no random plan, loader, profile or replay), for an A/B inside a short
   GPU lease; ``--plans balanced`` leaves out the random plan only.

The phases run in the order their results matter: the plans, the peers beside them, each A/B
(the peers again after one that changes the recipe to one they have not trained), then the
loader, profile and replay.
``--json`` is written after each phase: a run cut short keeps what it measured.
``--prepare-only`` makes the data, model, plans and shards (on the CPUs, no CUDA context) and
``--prepared`` trains them in a later call: gpu_session.sh prepares while its CUDA tests run.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import importlib.util
import itertools
import json
import os
import platform
import shutil
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from vlmshard.io import read_json, write_json_atomic  # noqa: E402

# Qwen3-VL-2B-Instruct's config.json sizes (text: Qwen3-1.7B's)
QWEN3_VL_2B = {
    "text_sizes": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       vocab_size=151936,
                       rope_parameters={"rope_type": "default", "rope_theta": 5e6,
                                        "mrope_section": [24, 20, 20],
                                        "mrope_interleaved": True}),
    "vision_sizes": dict(depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16,
                         out_hidden_size=2048, num_position_embeddings=2304,
                         deepstack_visual_indexes=[5, 11, 17]),
}
# vlmshard's runs, in the result's and the table's order
# ``--ab``: a name, and the train options its run flips (given the model's layer names)
AB = {"compiled": lambda names: {"compile_blocks": ["vit", "llm"]},
      # the recipe users run: the vision tower frozen (with --baseline, the peers train it too)
      "frozen_vit": lambda names: {"train": ["projector", "llm"]},
      "compiled_frozen_vit": lambda names: {"compile_blocks": ["vit", "llm"],
                                            "train": ["projector", "llm"]},
      "compiled_vit": lambda names: {"compile_blocks": ["vit"]},
      "no_liger": lambda names: {"liger": False},
      "no_vit_varlen": lambda names: {"vit_varlen": False},
      # the Qwen ViT through SDPA (equal-sized images batched), cuDNN's kernel first; and
      # with its blocks compiled too
      "cudnn_vit": lambda names: {"sdpa_cudnn": True},
      "compiled_cudnn_vit": lambda names: {"compile_blocks": ["vit"], "sdpa_cudnn": True},
      # every layer on SDPA, cuDNN's kernel first: the LLM's samples too (one call each, its
      # grouped K/V heads as they are) where torch's varlen kernel takes the micro-batch
      "cudnn": lambda names: {"attention": "sdpa", "sdpa_cudnn": True},
      "conv_patch": lambda names: {"patch_linear": False},
      # every LLM block recomputed whole: the recompute's FLOPs instead of selective
      # recompute's per-op dispatch on the host (4x a plain block's host time on a CPU:
      # benchmarks/host_overhead_bench.py)
      "full_recompute": lambda names: {"recompute": [n for n in names
                                                     if n.startswith("llm_block")]}}
RUNS = ("balanced", "random", *(f"balanced_{name}" for name in AB))
BASELINES = ("hf_packed", "hf_padded")
# Images up to 1024 merged patches (~1 Mpx): the demo's photos and documents keep their size.
BENCH_MAX_PIXELS = 32 * 32 * 1024
# --smoke: up to 64 merged patches, a quarter of the demo model's (steps of a CPU second)
SMOKE_MAX_PIXELS = 32 * 32 * 64


def preprocessed(work: str, scale: int, max_seq_len: int, model: str | None = None,
                 smoke: bool = False, untied_head: bool = False) -> tuple[str, str]:
    """``work`` made afresh: the demo data at ``scale``, the model folder (``model``, else the
    smoke's demo Qwen3-VL or one of Qwen3-VL-2B's sizes) and the data preprocessed for it.
    Returns the model folder and the preprocess output."""
    from vlmshard.families import tiny_folder
    from vlmshard.preprocess import PreprocessConfig, run_preprocess
    from vlmshard.demo.data import demo_model, generate

    shutil.rmtree(work, ignore_errors=True)
    data = generate(os.path.join(work, "data"), seed=0, scale=scale)
    if not model and smoke:
        model = demo_model("qwen3_vl", os.path.join(work, "model"), max_pixels=SMOKE_MAX_PIXELS)
    elif not model:
        model = tiny_folder("qwen3_vl", os.path.join(work, "model"), max_pixels=BENCH_MAX_PIXELS,
                            init_std=0.02, weights_dtype="bfloat16",
                            tie_word_embeddings=not untied_head, **QWEN3_VL_2B)
    pre = os.path.join(work, "preprocess")
    run_preprocess(PreprocessConfig(inputs=[data.meta], out=pre, model=model, keep_tokens=True,
                                    max_seq_len=max_seq_len, part_size=256))
    return model, pre


def prepare(args, device_bytes: int | None, plans: tuple[str, ...]) -> dict:
    """Model folder, preprocessed demo data, both plans, and the shards of the ``plans`` trained
    (the random plan is packed either way: the bench reports its caps). ``device_bytes``: the
    device's memory, whose recompute-free micro-batch sets random's samples and bounds balanced's
    caps (None, or ``--target-samples``: those samples, on CPU 8, and balanced under random's
    caps, as where that micro-batch does not hold random's)."""
    from vlmshard.packing.config import PackConfig
    from vlmshard.packing.plan import run_pack
    from vlmshard.shards.config import WriteConfig
    from vlmshard.shards.writer import run_write
    from vlmshard.train.capacity import device_capacity

    work = args.work
    model, pre = preprocessed(work, args.scale, args.max_seq_len, model=args.model,
                              smoke=args.smoke, untied_head=args.untied_head)
    bound = dataclasses.asdict(device_capacity(model, pre, device_bytes)) if device_bytes \
        else {}
    samples = args.target_samples or bound.get("recompute_free", {}).get("samples", 8)
    shards, caps = {}, {}
    for algo in ("random", "balanced"):
        plan = os.path.join(work, f"plan-{algo}")
        run_pack(PackConfig(stats=pre, dp=1, out=plan, algo=algo,
                            micro_batches=args.micro_batches, target_samples=samples,
                            **caps.get(algo, {})))
        if algo == "random":
            metrics = read_json(os.path.join(plan, "plan.json"))["metrics"]
            caps["random"] = {"max_qv": int(metrics["qv"]), "max_qt": int(metrics["qt"])}
            # where the device holds more than random's caps (not with --target-samples, nor
            # where even one largest sample needs recompute), balanced packs up to it
            free = {k: v for k, v in bound.get("recompute_free", {}).items() if k != "samples"}
            roomier = not args.target_samples and free and all(
                free[k] >= v for k, v in caps["random"].items())
            caps["balanced"] = free if roomier else caps["random"]
        if algo in plans:
            shards[algo] = os.path.join(work, f"shards-{algo}")
            run_write(WriteConfig(plan=plan, stats=pre, out=shards[algo], workers=1))
    return {"model": model, "shards": shards, "caps": caps["balanced"],
            "random_caps": caps["random"], "memory_bound": bound, "target_samples": samples}


def loader_throughput(shards: str, micro_batches: int, workers: int, cuda: bool,
                      dtype) -> dict:
    """The trainer's loader alone over the shards' first ``micro_batches``: those a plan's
    steps train."""
    from vlmshard.shards.loader import make_loader

    start, batches, tokens, tiles = time.perf_counter(), 0, 0, 0
    loader = make_loader(shards, num_workers=workers, pin_memory=cuda, pixel_dtype=dtype,
                         pad_pixels=False)
    for batch in itertools.islice(loader, micro_batches):
        batches += 1
        tokens += batch["num_tokens"]
        tiles += batch["num_tiles"]
    seconds = time.perf_counter() - start
    return {"micro_batches_per_s": batches / seconds, "tokens_per_s": tokens / seconds,
            "tiles_per_s": tiles / seconds}


def train_config(args, setup: dict, algo: str, run: str | None = None,
                 with_trace: bool = True, **options):
    """The options vlmshard trains a plan with (the baselines take its optimizer's); ``run``
    names the run's folder (default: the plan's), ``with_trace``: with ``--trace``, its second
    step is traced; ``options`` are further train options."""
    from vlmshard.train.config import TrainConfig

    run = run or algo
    return TrainConfig(shards=setup["shards"][algo], out=os.path.join(args.work, f"run-{run}"),
                       model=setup["model"], pp=1, dp=1, max_steps=args.steps,
                       save_checkpoints=False, count_host_syncs=True,
                       trace=os.path.join(args.trace, run) if args.trace and with_trace else None,
                       **{"train": args.train, "lora_rank": args.lora, **options})


def train_plan(args, setup: dict, algo: str, run: str | None = None, with_trace: bool = True,
               **options) -> dict:
    """Train one plan (``run``, ``with_trace``, ``options``: as ``train_config``); its step
    statistics after the warm-up steps."""
    from vlmshard.train.launcher import train_and_read_log

    cfg = train_config(args, setup, algo, run, with_trace, **options)
    out = cfg.out
    records = train_and_read_log(cfg, output=out + ".log")
    kept = [r for r in records[args.warmup:] if not r.get("traced")]
    times = sorted(r["step_time_s"] for r in kept)
    seconds = sum(times)
    tiles = sum(m["tiles"] for r in kept for d in r["data"] for m in d["micro_sizes"])
    syncs = [x["host_syncs"] for r in kept for x in r["ranks"] if "host_syncs" in x]
    peaks = [x["peak_memory_bytes"] for r in kept for x in r["ranks"]
             if "peak_memory_bytes" in x]
    pipeline = read_json(os.path.join(out, "pipeline.json"))
    recompute = [n for s in pipeline["stages"] for n in s["recompute"]]
    selective = [n for s in pipeline["stages"] for n in s["selective"]]
    attention = attention_flops(setup["model"], kept, cfg.recipe)
    model_flops = sum(r["model_flops"] for r in kept)
    return {"steps": len(kept), "kept_steps": [r["step"] for r in kept],
            "median_step_s": statistics.median(times),
            "p90_step_s": times[min(len(times) - 1, int(0.9 * len(times)))],
            "tokens_per_s": sum(r["tokens"] for r in kept) / seconds,
            "tiles_per_s": tiles / seconds,
            # every rate a sum over the kept steps over their summed time (not a median of
            # per-step ratios): the one count of tokens/s, MFU and HFU
            "model_flops_per_step": model_flops / len(kept),
            "vit_attention_share": sum(attention["vit"]) / model_flops,
            "mfu_flops_per_s": model_flops / seconds,
            # as Megatron-LM, torchtitan and llm-foundry count: causal attention's full square
            "mfu_full_attention_flops_per_s": (model_flops + sum(attention["causal"])) / seconds,
            "hfu_flops_per_s": sum(r["hardware_flops"] for r in kept) / seconds,
            **breakdown(kept),
            "peak_memory_bytes": max(peaks) if peaks else None,
            **{key: max((x[key] for r in kept for x in r["ranks"] if key in x), default=None)
               for key in ("peak_reserved_bytes", "outside_allocator_bytes")},
            # the memory model: at the caps (what the partition search trusted), and at each
            # kept step's largest micro-batch (what max_memory_allocated is held to)
            "predicted_peak_bytes": pipeline["stages"][0]["memory"]["predicted_peak_bytes"],
            "predicted_step_peak_bytes": predicted_step_peak(setup["model"], kept, recompute,
                                                             selective, pipeline["saves"]),
            "host_syncs_per_step": statistics.median(syncs) if syncs else None,
            "host_sync_sites": sync_sites(kept),
            # with --compile-blocks, torch.compile's compilations so far at each step's end
            "compilations": [max((x["compilations"] for x in r["ranks"] if "compilations" in x),
                                 default=None) for r in records],
            "loss": [r["loss"] for r in records],
            "trace": traced(cfg.trace),
            "partition": pipeline.get("partition_source", ""),
            "attention": pipeline.get("attention"), "kernels": pipeline.get("kernels", {}),
            "saves": pipeline["saves"],
            "recompute": recompute, "selective": selective}


def traced(folder: str | None) -> dict | None:
    """The traced step's device summary (``vlmshard.train.trace.summarize``): time by kernel
    class, the top kernels, the device's busy time against its span; and where the host's
    Python was in the sampled step after it (``host_sites``: seconds by function,
    ``vlmshard.train.trace.HostSampler``)."""
    if not folder:
        return None
    (name,) = [n for n in os.listdir(folder) if n.endswith("-summary.json")]
    sampled = [n for n in os.listdir(folder) if n.startswith("host-rank0-")]
    return {"file": os.path.join(folder, name.replace("-summary", "")),
            **read_json(os.path.join(folder, name)),
            **({"host_sites": read_json(os.path.join(folder, sampled[0]))} if sampled else {})}


def sync_sites(records: list[dict]) -> dict[str, float]:
    """Where the host waited for the device: each site's syncs per step and rank, over
    ``records``, most first."""
    from collections import Counter

    ranks = [x for r in records for x in r["ranks"]]
    sites = Counter()
    for x in ranks:
        sites.update(x.get("host_sync_sites", {}))
    return {site: n / len(ranks) for site, n in sites.most_common()}


def breakdown(records: list[dict]) -> dict:
    """Where a step's time went, in seconds by part (``train_log.time_breakdown``: each part of
    the model, recompute, optimizer, pipeline wait, data wait, other), the mean over
    ``records`` and their ranks; the mean step it splits, loading included; the host's time
    launching each part (``host_breakdown``: near the part's own, the part is host-bound); and
    the allocator's calls to the device per step (``allocator_calls``, GPU only)."""
    ranks = [x for r in records for x in r["ranks"]]

    def mean(key: str) -> dict[str, float]:
        return {k: statistics.fmean(x[key][k] for x in ranks) for k in ranks[0].get(key, {})}

    return {"time_breakdown": mean("time_breakdown"),
            "breakdown_step_s": statistics.fmean(x["step_time_s"] + x["load_s"] for x in ranks),
            "host_breakdown": mean("host_breakdown"),
            "allocator_calls": mean("allocator_calls")}


def profile_kinds(args, setup: dict, device_bytes: int | None) -> dict:
    """``vlmshard train profile`` of the model on the balanced shards' first micro-batches
    (into ``work/profile``) and the FLOP rate it measured per layer kind
    (``sustained_flops_per_s``): what the simulator's replay runs each layer at."""
    from vlmshard.simulate.model import sustained_flops_per_s
    from vlmshard.train.config import ProfileConfig
    from vlmshard.train.hf_model import model_layers
    from vlmshard.train.profile import run_profile

    out = os.path.join(args.work, "profile")
    run_profile(ProfileConfig(shards=setup["shards"]["balanced"], out=out, model=setup["model"],
                              pp=1, dp=1, micro_batches=2 if args.smoke else args.micro_batches,
                              # --smoke: two micro-batches, one timed run of each layer on each
                              **({"repeats": 1, "warmup": 0} if args.smoke else {}),
                              **({"memory_budget": device_bytes} if device_bytes else {})))
    profile = read_json(os.path.join(out, "profile.json"))
    return {"dir": out, "flops_per_s": sustained_flops_per_s(
        profile, model_layers(setup["model"]).analytic_work())}


def replayed(args, run: str, profile_dir: str, kept: list[int]) -> dict:
    """The simulator's replay of a plan's run (analytic FLOPs at the profile's rate per layer
    kind) against its measured step times, over the ``kept`` steps (after the warm-up, the
    traced one left out): the median predicted step and each step's relative error."""
    from vlmshard.simulate.replay import replay_run, step_seconds

    replay = replay_run(os.path.join(args.work, f"run-{run}", "train_log.jsonl"), profile_dir,
                        per_kind=True)
    steps = [s for s in step_seconds(replay)["per_step"] if s["step"] in kept]
    return {"predicted_step_s": statistics.median(s["predicted_s"] for s in steps),
            "replay_step_error": [s["predicted_s"] / s["measured_s"] - 1 for s in steps]}


def hf_baseline(args, setup: dict, padded: bool, run: str = "balanced", **options) -> dict:
    """``hf_train``'s run of vlmshard's run ``run`` (trained with the train ``options``: its
    recipe): its time, tokens/s, model FLOP/s and loss per step, and the device's
    memory handed back (gradients, optimizer states and the model gone). As a user tunes it:
    without gradient checkpointing; where that runs out of the device's memory, packed, each
    micro-batch cut in two and accumulated (``split``: no recompute, half the activations);
    then with checkpointing on whole micro-batches (``gradient_checkpointing`` and ``split``
    say which ran); out of memory with it too, the peer's own limit at this budget is the
    result (``error``)."""
    import gc

    import torch

    from vlmshard.run_log import read_log

    tries = [(1, False)] + [(2, False)] * (not padded) + [(1, True)]
    trained, error = None, None
    for split, checkpointing in tries if torch.cuda.is_available() else tries[:1]:
        try:
            trained = hf_train(args, setup, padded, checkpointing, run, split=split, **options)
        except torch.OutOfMemoryError as e:
            error = (f"out of memory{' with gradient checkpointing' * checkpointing}"
                     f"{f', micro-batches cut in {split}' * (split > 1)}: "
                     f"{str(e).splitlines()[0]}")
            print(f"hf_{'padded' if padded else 'packed'}: {error}", flush=True)
        # outside the handler (its traceback holds the model): the Trainer's reference cycles
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        if trained:
            break
    if trained is None:
        return {"error": error}
    configured, times, losses = trained
    logged = read_log(os.path.join(train_config(args, setup, "balanced", run, **options).out,
                                   "train_log.jsonl"))
    logged, kept = logged[args.warmup:args.steps], times[args.warmup:]
    return {**configured, "gradient_checkpointing": checkpointing, "split": split,
            "steps": len(kept), "median_step_s": statistics.median(kept),
            "tokens_per_s": sum(r["tokens"] for r in logged) / sum(kept),
            "mfu_flops_per_s": sum(r["model_flops"] for r in logged) / sum(kept),
            "loss": losses}


def hf_train(args, setup: dict, padded: bool, checkpointing: bool, run: str = "balanced",
             split: int = 1, **options) -> tuple[dict, list[float], list[float]]:
    """The balanced shards' steps trained by Hugging Face's ``Trainer`` (examples/hf_trainer.py):
    packed (``model_inputs``: flash-attn's varlen kernel where it is installed, else torch's
    through the same ``transformers`` path, ``TORCH_VARLEN``: the ViT's images in one call, no
    mask over the micro-batch) or padded per sample (SDPA); vlmshard's optimizer, schedule,
    clipping, steps and precision (fp32 master weights, bf16 compute on a GPU; fp32 on CPU),
    with gradient checkpointing where ``checkpointing`` says, packed micro-batches each cut into
    ``split`` (``PackedBatches``), on the recipe of vlmshard's run ``run`` (its ``options``, as
    ``hf_baseline``). Each step's time is vlmshard's
    ``step_time_s``'s: from its micro-batches in hand (the ``Trainer`` fetches a step's before
    ``on_step_begin``; vlmshard logs its wait for them apart, ``load_s``) to the end of its
    optimizer step on the device; tokens and model FLOPs are vlmshard's log's for the same step
    (the same samples). As a user who read the docs configures it, on what vlmshard's rank
    takes: Liger's kernels (``use_liger_kernel``) where Liger is installed on a GPU, the same
    intra-op threads and the same patch embedding (a matmul per patch where vlmshard runs
    one). Returns that configuration (``attention``, ``liger``, ``threads``, ``patch_linear``),
    and per step its seconds and loss."""
    import torch
    from transformers import AutoModelForImageTextToText, TrainerCallback
    from transformers.utils import is_flash_attn_2_available

    from vlmshard.shards.model_inputs import TORCH_VARLEN
    from vlmshard.train.attention import attend_with_torch_varlen
    from vlmshard.train.hf_model import model_layers
    from vlmshard.train.models.qwen2vl import patch_embedding_as_matmul
    from vlmshard.train.trainer import cpu_threads_per_rank, gpu_rank_threads

    sys.path.insert(0, os.path.join(REPO, "examples"))
    from hf_trainer import PackedBatches, PaddedBatches, shard_trainer

    cuda = torch.cuda.is_available()
    cfg = train_config(args, setup, "balanced", run, **options)  # its recipe and optimizer
    flash = cuda and is_flash_attn_2_available()
    model = AutoModelForImageTextToText.from_pretrained(
        setup["model"], dtype=torch.float32,
        attn_implementation="flash_attention_2" if flash else "sdpa")
    attention = "flash_attention_2" if flash else "sdpa" if padded else TORCH_VARLEN
    if attention == TORCH_VARLEN:
        attend_with_torch_varlen(model)
    model = model_layers(setup["model"], recipe=cfg.recipe).as_recipe(model)  # the same recipe
    # the padded peer: as many micro-batches a step as keep each, padded, within the packed
    # micro-batch's tokens over the steps trained (``PaddedBatches``)
    batches = (functools.partial(PaddedBatches, steps=args.steps) if padded
               else functools.partial(PackedBatches, split=split))
    workers = args.loader_workers if args.loader_workers is not None else (4 if cuda else 0)
    cfg.resolve_device_defaults(cuda)  # vlmshard's per-device choices, which the peer takes
    torch.set_num_threads(gpu_rank_threads(workers) if cuda else cpu_threads_per_rank(1))
    patch_embeds = [m for name, m in model.named_modules() if name.endswith("patch_embed")
                    and isinstance(getattr(m, "proj", None), torch.nn.Conv3d)]
    for patch_embed in patch_embeds if cfg.patch_linear else []:
        patch_embedding_as_matmul(patch_embed)
    liger_missing = liger_patch_missing(model.config.model_type) if cuda else "no GPU"
    liger = liger_missing is None
    configured = {"attention": attention, "liger": liger, "threads": torch.get_num_threads(),
                  "patch_linear": bool(cfg.patch_linear and patch_embeds)}
    if liger_missing:
        configured["liger_missing"] = liger_missing

    class Clock(TrainerCallback):
        def __init__(self) -> None:
            self.times, self.losses = [], []

        def now(self) -> float:
            if cuda:
                torch.cuda.synchronize()
            return time.perf_counter()

        def on_step_begin(self, *_, **__) -> None:
            self.start = self.now()

        def on_step_end(self, *_, **__) -> None:
            self.times.append(self.now() - self.start)

        def on_log(self, *_, logs=None, **__) -> None:
            if logs and "loss" in logs:
                self.losses.append(logs["loss"])

    clock = Clock()
    out = os.path.join(args.work, f"hf-{'padded' if padded else 'packed'}")
    shard_trainer(
        model, lambda rank, world: batches(setup["shards"]["balanced"], model, rank, world,
                                           workers=workers),
        out, args.steps, callbacks=[clock], learning_rate=cfg.lr,
        lr_scheduler_type=cfg.lr_scheduler_type, warmup_steps=cfg.warmup_steps_of(args.steps),
        weight_decay=cfg.weight_decay, max_grad_norm=cfg.max_grad_norm,
        optim="adamw_torch_fused", bf16=cuda, gradient_checkpointing=checkpointing,
        use_liger_kernel=liger).train()
    return configured, clock.times, clock.losses


def liger_patch_missing(model_type: str) -> str | None:
    """Why ``use_liger_kernel=True`` cannot run for ``model_type`` here, or None where it can.
    The ``Trainer`` imports Liger's module for the model inside ``train()``; where that module
    does not import against this ``transformers`` (Liger 0.8.5's ``qwen3_vl`` wants
    ``Qwen3VLCausalLMOutputWithPast``, which transformers 5.23 no longer has), a user has to
    train without Liger, and so does the peer."""
    if importlib.util.find_spec("liger_kernel") is None:
        return "liger_kernel is not installed"
    module = f"liger_kernel.transformers.model.{model_type}"
    try:
        importlib.import_module(module)
    except ImportError as error:  # Liger's own module against this transformers
        if getattr(error, "name", None) != module:  # a model Liger has no module for is fine
            return f"{type(error).__name__}: {error}"
    return None


def attention_flops(model: str, records: list[dict], recipe) -> dict[str, list[float]]:
    """Per step of ``records``, two parts of its model FLOPs (``model_sizes.training_flops``
    at its micro-batches' logged sizes): ``vit``, a Qwen ViT's attention across each image,
    video temporal step or window (``model_sizes.vit_attention_size``; none where the ViT
    attends within a tile), which a count linear in tiles leaves out; ``causal``, the LLM's
    causal attention, counted as the half square it computes, which Megatron-LM, torchtitan
    and llm-foundry count twice (their MFU takes causal attention as the full square). Each
    layer counted as ``recipe`` runs it (``vlmshard.recipe``)."""
    from vlmshard.families import model_sizes
    from vlmshard.model_sizes import CostTerms, training_flops

    flops = training_flops(model_sizes(read_json(os.path.join(model, "config.json")), model),
                           recipe)
    parts = {"vit": CostTerms(vit_squares=flops.vit_squares, vit_windows=flops.vit_windows),
             "causal": CostTerms(squares=flops.squares, windowed=flops.windowed)}
    return {name: [sum(part.dot(CostTerms(**m)) for d in r["data"] for m in d["micro_sizes"])
                   for r in records] for name, part in parts.items()}


def predicted_step_peak(model: str, records: list[dict], recompute: list[str],
                        selective: list[str], saves: dict) -> int:
    """The memory model's peak for the largest micro-batch of any of ``records``' steps, one
    bf16 stage holding the whole model, recomputing ``recompute`` whole and ``selective``
    selectively, its layers keeping what the run's kernels keep (``saves``, as
    ``pipeline.json`` records them)."""
    from vlmshard.families import model_sizes
    from vlmshard.model_sizes import Saves, CostTerms, bytes_per_param, trainer_layer_work
    from vlmshard.partition import predicted_stage_peak
    from vlmshard.train.hf_model import model_layers

    names = model_layers(model).names
    again = [names.index(n) for n in recompute]
    partly = [names.index(n) for n in selective]
    work = trainer_layer_work(names, model_sizes(read_json(os.path.join(model, "config.json")),
                                                 model), Saves(**saves))
    def largest(d: dict) -> CostTerms:
        return CostTerms(max(m["tiles"] for m in d["micro_sizes"]),
                         max(m["tokens"] for m in d["micro_sizes"]))

    return max(predicted_stage_peak(work, again, largest(d), 1, bytes_per_param("bf16", 1),
                                    partly)["predicted_peak_bytes"]
               for r in records for d in r["data"])


def environment(cuda: bool) -> dict:
    import deepspeed
    import torch
    import transformers

    return {"device": torch.cuda.get_device_name(0) if cuda else platform.processor() or "cpu",
            "host": platform.node(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
            "deepspeed": deepspeed.__version__, "transformers": transformers.__version__}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true",
                   help="the same path on CPU with the tests' tiny model, in seconds")
    p.add_argument("--model", help="a model folder to train (default: Qwen3-VL-2B's sizes "
                                   "with random weights)")
    p.add_argument("--untied-head", action="store_true",
                   help="Qwen3-VL-2B's sizes with an LM head of its own, not tied to the token "
                        "embedding as published (the model of the GPU runs before 2026-11-28)")
    p.add_argument("--work", default=os.path.join(REPO, "build", "gpu_bench"))
    p.add_argument("--scale", type=int, default=None, help="demo data scale (default 4; "
                                                            "smoke 1)")
    p.add_argument("--steps", type=int, default=None, help="steps per plan (default 13; "
                                                            "smoke 3)")
    p.add_argument("--warmup", type=int, default=None, help="steps dropped (default 3; "
                                                             "smoke 1)")
    p.add_argument("--micro-batches", type=int, default=4, help="per step")
    p.add_argument("--train", nargs="+", default=["vit", "projector", "llm"], metavar="PART",
                   help="the parts that train (vlmshard train --train), for vlmshard and the "
                        "peers alike: 'projector llm' is the recipe users run, the vision "
                        "tower frozen (default: all, a full fine-tune)")
    p.add_argument("--lora", type=int, default=0, metavar="RANK",
                   help="train the LLM through LoRA adapters of this rank (vlmshard train "
                        "--lora-rank; the peers through PEFT's same adapters); 0: none")
    p.add_argument("--target-samples", type=int, default=None,
                   help="samples per random micro-batch, balanced packed under random's caps "
                        "(default: as many as the memory model lets the device hold "
                        "recomputing no layer whole, balanced packed up to that micro-batch; "
                        "8 with --smoke, balanced under random's caps)")
    p.add_argument("--max-seq-len", type=int, default=8192)
    p.add_argument("--loader-workers", type=int, default=None,
                   help="the trainer's default: 4 on GPU, 0 on CPU")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="dense bf16 peak of the device (default: vlmshard.hardware's table)")
    p.add_argument("--baseline", nargs="*", choices=BASELINES, default=None,
                   help="also train the balanced shards' steps with Hugging Face's Trainer, "
                        "packed and padded per sample (or the ones named), and report them "
                        "beside vlmshard")
    p.add_argument("--quick", action="store_true",
                   help="the balanced plan alone: no random plan, loader, profile or replay "
                        "(an A/B on a leased GPU in a few minutes)")
    p.add_argument("--plans", nargs="+", choices=("balanced", "random"),
                   default=["balanced", "random"],
                   help="the plans trained (the balanced one always: the baselines and --ab "
                        "train its steps)")
    p.add_argument("--ab", nargs="+", choices=list(AB), default=[],
                   help="also train the balanced plan with one switch flipped, each beside the "
                        "run with the defaults: compiled (--compile-blocks vit llm), "
                        "compiled_vit (--compile-blocks vit), frozen_vit (--train projector "
                        "llm: the vision tower frozen; the peers train it too), "
                        "compiled_frozen_vit (both), cudnn_vit "
                        "(--sdpa-cudnn), "
                        "compiled_cudnn_vit (both), cudnn (--attention sdpa --sdpa-cudnn), "
                        "no_liger "
                        "(--no-liger), no_vit_varlen (--no-vit-varlen), conv_patch "
                        "(--no-patch-linear), full_recompute (every "
                        "LLM block recomputed whole, not selectively)")
    p.add_argument("--json", help="also write the result here (after each phase)")
    staged = p.add_mutually_exclusive_group()
    staged.add_argument("--prepare-only", action="store_true",
                        help="make the data, model, plans and shards under --work, write what "
                             "they are to its setup.json, and stop: on the CPUs, while the "
                             "device runs something else (gpu_session.sh: its CUDA tests)")
    staged.add_argument("--prepared", action="store_true",
                        help="train what --work's setup.json says (a --prepare-only run's, "
                             "with the same data options) instead of preparing again")
    p.add_argument("--trace", help="write a torch profiler trace (Chrome trace JSON) of each "
                                   "plan's second step under this folder (not the --ab "
                                   "runs'); that step is left out of the figures")
    args = p.parse_args()
    smoke = args.smoke
    args.scale = args.scale or (1 if smoke else 4)
    args.steps = args.steps or (3 if smoke else 13)
    args.warmup = 1 if smoke and args.warmup is None else (3 if args.warmup is None
                                                           else args.warmup)
    if args.steps <= args.warmup:
        p.error("--steps must exceed --warmup")
    if "balanced" not in args.plans:
        p.error("--plans must include balanced")
    if args.untied_head and (args.model or smoke):
        p.error("--untied-head changes the bench's own model: not with --model or --smoke")

    import torch

    from vlmshard.errors import JobError
    from vlmshard.families import model_sizes
    from vlmshard.hardware import gpu_named
    from vlmshard.train.attention import choose_backend
    from vlmshard.train.default_partition import Device

    cuda = torch.cuda.is_available()
    if not cuda and not smoke:
        p.error("no CUDA device: run with --smoke on CPU")
    dtype = torch.bfloat16 if cuda else torch.float32
    # This process makes no CUDA context until the plans have trained: one would hold half a
    # GiB of the device the training process needs (the first H100 run's out-of-memory).
    device = Device.probe() if cuda else None
    gpu = gpu_named(device.name) if device else None
    peak = args.peak_tflops * 1e12 if args.peak_tflops else (gpu.peak_flops if gpu else None)
    plans = ("balanced",) if args.quick else tuple(args.plans)
    setup_file = os.path.join(args.work, "setup.json")
    if args.prepared:
        setup = read_json(setup_file)
        if not set(plans) <= set(setup["shards"]):
            p.error(f"--prepared: {setup_file} has shards of {', '.join(setup['shards'])} only")
    else:
        setup = prepare(args, device.memory_bytes if device else None, plans)
    if args.prepare_only:
        write_json_atomic(setup_file, setup)
        return
    runs = {algo: train_plan(args, setup, algo) for algo in plans}
    workers = args.loader_workers if args.loader_workers is not None else (4 if cuda else 0)
    result = {**environment(cuda), "attention": choose_backend("cuda" if cuda else "cpu", dtype),
              "model": os.path.basename(setup["model"].rstrip("/")),
              "tied_head": model_sizes(read_json(os.path.join(setup["model"], "config.json")),
                                       setup["model"]).llm.tied_embeddings,
              "caps": setup["caps"], "random_caps": setup["random_caps"],
              "memory_bound": setup["memory_bound"], "target_samples": setup["target_samples"],
              "peak_flops": peak, **runs}
    save(args, result, peak)
    # the phases in the order their results matter: the peers beside the defaults, then each
    # A/B, the peers again after one that changes what trains to a recipe they have not trained
    peers(args, setup, result, peak)
    recipes = {None}
    if args.ab:
        from vlmshard.train.hf_model import model_layers

        names = model_layers(setup["model"]).names
    for name in args.ab:
        options = AB[name](names)
        # not traced: the trace and its summary take a lease's minutes; the traced step is a
        # warm-up step with the defaults
        try:
            result[f"balanced_{name}"] = train_plan(args, setup, "balanced", f"balanced-{name}",
                                                    with_trace=False, **options)
        except JobError as e:  # a switch that fails on this device is its result: go on
            result[f"balanced_{name}"] = {"error": str(e)}
        save(args, result, peak)
        recipe = tuple(options["train"]) if "train" in options else None
        if recipe not in recipes and "error" not in result[f"balanced_{name}"]:
            recipes.add(recipe)
            peers(args, setup, result, peak, name, **options)
    if not args.quick:
        result["loader"] = loader_throughput(setup["shards"]["balanced"],
                                             args.steps * args.micro_batches, workers, cuda,
                                             dtype)
        profile = profile_kinds(args, setup, device.memory_bytes if device else None)
        result["sustained_flops_per_s"] = profile["flops_per_s"]
        if peak:
            result["sustained_share"] = {k: v / peak for k, v in profile["flops_per_s"].items()}
        for algo, run in runs.items():
            run.update(replayed(args, algo, profile["dir"], run["kept_steps"]))
        save(args, result, peak)
    print(json.dumps(result))
    print(table(result))


def peers(args, setup: dict, result: dict, peak: float | None, ab: str | None = None,
          **options) -> None:
    """With ``--baseline``, each peer trains the recipe of the balanced run with the defaults,
    or of its A/B ``ab`` (that run's train ``options``), as ``baseline[peer]`` or
    ``baseline[peer_ab]``; the result saved after each."""
    if args.baseline is None:
        return
    for name in args.baseline or BASELINES:
        result.setdefault("baseline", {})[f"{name}_{ab}" if ab else name] = hf_baseline(
            args, setup, name == "hf_padded", f"balanced-{ab}" if ab else "balanced", **options)
        save(args, result, peak)


def save(args, result: dict, peak: float | None) -> None:
    """Each run's MFU and HFU where the peak is known; the result so far to ``--json``, after
    each phase (a run cut short keeps what it measured)."""
    runs = [result[k] for k in RUNS if k in result]
    for run in [*runs, *result.get("baseline", {}).values()]:
        if peak and "mfu_flops_per_s" in run:
            run["mfu"] = run["mfu_flops_per_s"] / peak
            if "hfu_flops_per_s" in run:
                run["hfu"] = run["hfu_flops_per_s"] / peak
            if "mfu_full_attention_flops_per_s" in run:
                run["mfu_full_attention"] = run["mfu_full_attention_flops_per_s"] / peak
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)


def table(result: dict) -> str:
    def fmt(value, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    lines = [f"{result['device']} | torch {result['torch']} CUDA {result['cuda']} NCCL "
             f"{result['nccl']} | DeepSpeed {result['deepspeed']} | transformers "
             f"{result['transformers']} | attention {result['attention']}",
             "loader alone: " + (f"{result['loader']['tokens_per_s']:,.0f} tokens/s, "
                                 f"{result['loader']['tiles_per_s']:,.0f} tiles/s"
                                 if "loader" in result else "-"),
             f"micro-batches: balanced up to {result['caps']['max_qv']:,} tiles and "
             f"{result['caps']['max_qt']:,} tokens; random {result['target_samples']} samples "
             f"(up to {result['random_caps']['max_qv']:,} and "
             f"{result['random_caps']['max_qt']:,})",
             f"{'plan':<22} {'median s':>9} {'p90 s':>7} {'tokens/s':>9} {'tiles/s':>8} "
             f"{'MFU':>6} {'HFU':>6} {'peak GiB':>8} {'model GiB':>9} {'syncs':>5} "
             f"{'predicted s':>11} {'replay error':>12}"]
    for algo in RUNS:
        if algo not in result:
            continue
        r = result[algo]
        if "error" in r:
            lines.append(f"{algo:<22} {r['error']}")
            continue
        errors = r.get("replay_step_error")
        peak = r["peak_memory_bytes"] / 2**30 if r["peak_memory_bytes"] else None
        lines.append(f"{algo:<22} {r['median_step_s']:>9.3f} {r['p90_step_s']:>7.3f} "
                     f"{r['tokens_per_s']:>9,.0f} {r['tiles_per_s']:>8,.0f} "
                     f"{fmt(r.get('mfu'), '.1%'):>6} {fmt(r.get('hfu'), '.1%'):>6} "
                     f"{fmt(peak, '.1f'):>8} "
                     f"{r['predicted_step_peak_bytes'] / 2**30:>9.1f} "
                     f"{fmt(r['host_syncs_per_step'], '.0f'):>5} "
                     f"{fmt(r.get('predicted_step_s'), '.3f'):>11} "
                     f"{fmt(errors and statistics.median(map(abs, errors)), '.1%'):>12}")
    for name, r in result.get("baseline", {}).items():
        if "error" in r:
            lines.append(f"{name:<22} {r['error']}")
            continue
        split = r.get("split", 1)
        lines.append(f"{name:<22} {r['median_step_s']:>9.3f} {'-':>7} {r['tokens_per_s']:>9,.0f} "
                     f"{'-':>8} {fmt(r.get('mfu'), '.1%'):>6}   ({r['attention']}"
                     f"{', gradient checkpointing' * r['gradient_checkpointing']}"
                     f"{f', micro-batches cut in {split}' * (split > 1)})")
    for algo in RUNS:
        if share := result.get(algo, {}).get("vit_attention_share"):
            lines.append(f"{algo}: its MFU counts the ViT's attention across each image, "
                         f"{share:.1%} of the model FLOPs")
        if full := result.get(algo, {}).get("mfu_full_attention"):
            lines.append(f"{algo}: MFU {full:.1%} with the LLM's causal attention counted as "
                         "the full square, as Megatron-LM, torchtitan and llm-foundry count it "
                         "(the MFU above counts the half it computes)")
    for algo in RUNS:
        trace = result.get(algo, {}).get("trace")
        if trace and trace["device_span_s"]:
            lines.append(f"{algo} traced step: device busy {trace['device_busy_s']:.3f} s of "
                         f"{trace['device_span_s']:.3f} s; " + ", ".join(
                             f"{cls} {s:.3f}" for cls, s in trace["by_class"].items()))
            lines.append(f"{algo} device by layer: " + "; ".join(
                f"{kind} {sum(classes.values()):.3f} (" + ", ".join(
                    f"{cls} {s:.3f}" for cls, s in classes.items()) + ")"
                for kind, classes in trace.get("by_layer", {}).items()))
            lines.append(f"{algo} device idle, the host in: " + ", ".join(
                f"{name[:60]} {s:.3f}" for name, s in list(trace["device_idle_host"].items())[:8]))
        if trace and "host_sites" in trace:
            sites = trace["host_sites"]
            lines.append(f"{algo} the host's Python in a step of {sites['sampled_s']:.3f} s: "
                         + ", ".join(f"{site} {s:.3f}" for site, s in sorted(
                             sites["seconds"].items(), key=lambda kv: -kv[1])[:8]))
    for algo in RUNS:
        if algo not in result or "error" in result[algo]:
            continue
        r = result[algo]
        lines.append(f"{algo} step of {r['breakdown_step_s']:.3f} s: " + ", ".join(
            f"{part} {s:.3f}" for part, s in r["time_breakdown"].items()))
        lines.append(f"{algo} the host launching: " + ", ".join(
            f"{part} {s:.3f}" for part, s in r["host_breakdown"].items()))
        if r["allocator_calls"]:
            lines.append(f"{algo} allocator per step: " + ", ".join(
                f"{name} {n:g}" for name, n in r["allocator_calls"].items()))
        if any(n is not None for n in r.get("compilations", ())):
            lines.append(f"{algo} torch.compile compilations so far, by step: "
                         + ", ".join(str(n) for n in r["compilations"]))
    return "\n".join(lines)


if __name__ == "__main__":
    main()
