"""Training throughput from balanced against random plans, step time against padding, and the
searched stage partition against DeepSpeed's, measured on real DeepSpeed runs of the demo's tiny
InternVL (``InternVLForConditionalGeneration``, random weights), or of another family's tiny
model (``--model-type qwen3_vl``).

    python benchmarks/train_bench.py                  # about 40 minutes on 2 vCPUs

Data: the demo dataset (``--scale``), preprocessed for that model with kept tokens.

1. Plan ``random`` for DP=2 and write its shards; ``vlmshard train profile`` on them (PP=2) gives
   the tiny model's measured cost model and the stage partitions (search, DeepSpeed's
   ``parameters`` and ``uniform``).
2. Plan ``balanced`` for DP=2 with that measured cost model (the loop between data and model
   balance) and write its shards. Both plans hold the same samples.
3. DP=2 (PP=1), one process per core: train the first ``--dp-steps`` steps of each plan (the
   steps are shuffled over the epoch, so these are a fair sample), alternating plans,
   ``--repeats`` times. Throughput = Σ tokens / Σ step time; waiting fraction of a rank =
   Σ wait_s / Σ step time (``wait_s`` is step time less the rank's own forward and backward; every
   step starts on a barrier, so data loading is not counted); imbalance fraction = Σ over steps
   and ranks of (busiest rank's forward + backward − this rank's) / (ranks × Σ step time), the
   part of the waiting that imbalance causes.
4. PP=2 (DP=1) on the balanced shards: each partition trains ``--steps`` steps, alternating,
   ``--repeats`` times; the measured step time is the median after the first (warm-up) step.
   The partitions: the profiled search's, DeepSpeed's ``parameters`` and ``uniform``, and
   ``analytic``, what a run takes when it names none (the search over the model's analytic
   costs, ``vlmshard.train.default_partition``).
5. Padding: the ``random`` shards again with the manifest's caps doubled (a copy whose
   ``manifest.json`` says 2·Qv and 2·Qt: the same records, which the loader then pads to twice
   the tiles and tokens), DP=1 PP=1, alternating with the original, ``--steps`` steps each: the
   trainer computes on real rows only, so the step time should not follow the caps.
6. Every run is also re-simulated from its train_log with the profile's measured layer times
   (``vlmshard simulate --train-log``): the simulator's median per-step error.

Medians over repeats; ratios are taken within one run, side by side.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from vlmshard.packing.config import PackConfig  # noqa: E402
from vlmshard.packing.plan import run_pack  # noqa: E402
from vlmshard.preprocess import PreprocessConfig, run_preprocess  # noqa: E402
from vlmshard.demo.data import generate  # noqa: E402
from vlmshard.shards.config import WriteConfig  # noqa: E402
from vlmshard.shards.writer import run_write  # noqa: E402
from vlmshard.train.launcher import train_and_read_log  # noqa: E402
from vlmshard.demo.data import demo_model  # noqa: E402
from vlmshard.train.config import ProfileConfig  # noqa: E402
from vlmshard.train.profile import run_profile  # noqa: E402
from vlmshard.simulate.replay import validate_against_log  # noqa: E402
from vlmshard.train.config import TrainConfig  # noqa: E402
from vlmshard.io import read_json, write_json_atomic  # noqa: E402

def prepare(work: str, scale: int, model_type: str, memory_budget: str) -> dict:
    """Preprocess, plan ``random`` (and padded to twice its caps), profile, plan ``balanced``
    with the measured costs."""
    shutil.rmtree(work, ignore_errors=True)
    data = generate(os.path.join(work, "data"), seed=0, scale=scale)
    model = demo_model(model_type, os.path.join(work, "model"))
    pre = os.path.join(work, "preprocess")
    budget = {"tile_budget": "per-sample"} if model_type == "internvl" else {}  # as the demo
    run_preprocess(PreprocessConfig(inputs=[data.meta], out=pre, model=model, keep_tokens=True,
                                    max_seq_len=8192, part_size=256, **budget))
    shards = {}

    def plan_and_write(name: str, **options) -> None:
        plan = os.path.join(work, f"plan-{name}")
        run_pack(PackConfig(stats=pre, dp=2, out=plan, **options))
        shards[name] = os.path.join(work, f"shards-{name}")
        run_write(WriteConfig(plan=plan, stats=pre, out=shards[name], workers=1))

    plan_and_write("random", algo="random")
    padded = os.path.join(work, "shards-random-2x-caps")
    shutil.copytree(shards["random"], padded)
    manifest = read_json(os.path.join(padded, "manifest.json"))
    write_json_atomic(os.path.join(padded, "manifest.json"),
                      {**manifest, "qv": 2 * manifest["qv"], "qt": 2 * manifest["qt"]})
    profile = os.path.join(work, "profile")
    run_profile(ProfileConfig(shards=shards["random"], out=profile, model=model, pp=2,
                              micro_batches=8, memory_budget=memory_budget))
    plan_and_write("balanced", algo="balanced",
                   cost_model=os.path.join(profile, "cost_model.json"))
    return {"shards": shards, "padded": padded, "model": model, "profile": profile,
            "plans": {name: read_json(os.path.join(work, f"plan-{name}", "plan.json"))["metrics"]
                      for name in shards}}


def summarize(log: list[dict], run: str, profile: str, skip: int = 1) -> dict:
    """Throughput, per-rank waiting fraction and the simulator's error on a run's train_log."""
    records = log[skip:]
    check = validate_against_log(os.path.join(run, "train_log.jsonl"), profile)
    seconds = sum(r["step_time_s"] for r in records)
    ranks = sorted({r["rank"] for r in records[0]["ranks"]})
    wait = {rank: sum(x["wait_s"] for r in records for x in r["ranks"] if x["rank"] == rank)
            for rank in ranks}
    # The waiting that imbalance causes: each rank's compute short of the step's busiest rank.
    # (wait_s also holds what every rank spends outside its layers: the gradient all-reduce, the
    # optimizer step, DeepSpeed's bookkeeping.)
    compute = [[x["forward_s"] + x["backward_s"] for x in r["ranks"]] for r in records]
    imbalance = sum(max(c) - x for c in compute for x in c) / (len(ranks) * seconds)
    return {"steps": len(records), "seconds": seconds,
            "tokens_per_s": sum(r["tokens"] for r in records) / seconds,
            "wait_fraction": {str(rank): w / seconds for rank, w in wait.items()},
            "imbalance_fraction": imbalance,
            "median_step_s": statistics.median(r["step_time_s"] for r in records),
            "simulated_total_error": check["total_error"],
            "simulated_median_step_error": check["median_step_error"]}


def bench_balance(work: str, setup: dict, steps: int, repeats: int) -> dict:
    runs = {name: [] for name in setup["shards"]}
    for i in range(repeats):
        for name, shards in setup["shards"].items():
            out = os.path.join(work, "runs", f"dp-{name}-{i}")
            log = train_and_read_log(TrainConfig(
                shards=shards, out=out, model=setup["model"], pp=1, dp=2,
                max_steps=steps or None, save_checkpoints=False))
            runs[name].append(summarize(log, out, setup["profile"]))
            print(f"  dp=2 {name:<9} repeat {i}: {runs[name][-1]['tokens_per_s']:.0f} tokens/s, "
                  f"waiting {runs[name][-1]['wait_fraction']}", flush=True)
    result = {}
    for name, rs in runs.items():
        result[name] = {
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rs),
            "wait_fraction": statistics.median(max(r["wait_fraction"].values()) for r in rs),
            "mean_wait_fraction": statistics.median(
                statistics.mean(r["wait_fraction"].values()) for r in rs),
            "imbalance_fraction": statistics.median(r["imbalance_fraction"] for r in rs),
            "predicted_cost_efficiency": setup["plans"][name]["cost_efficiency"],
            "runs": rs}
    result["throughput_ratio"] = statistics.median(
        b["tokens_per_s"] / r["tokens_per_s"] for b, r in zip(runs["balanced"], runs["random"]))
    return result


def bench_padding(work: str, setup: dict, steps: int, repeats: int) -> dict:
    """The same micro-batches at their plan's caps and at twice the caps (DP=1, PP=1)."""
    runs = {"caps": setup["shards"]["random"], "2x caps": setup["padded"]}
    times, fill = {name: [] for name in runs}, {}
    for i in range(repeats):
        for name, shards in runs.items():
            out = os.path.join(work, "runs", f"pad-{name.replace(' ', '')}-{i}")
            log = train_and_read_log(TrainConfig(
                shards=shards, out=out, model=setup["model"], pp=1, dp=1,
                max_steps=steps, save_checkpoints=False))
            times[name].append(statistics.median(r["step_time_s"] for r in log[1:]))
            manifest = read_json(os.path.join(shards, "manifest.json"))
            tokens = [m["tokens"] for r in log[1:] for d in r["data"] for m in d["micro_sizes"]]
            fill[name] = statistics.mean(tokens) / manifest["qt"]
            print(f"  padding {name:<8} repeat {i}: {times[name][-1]:.3f} s/step, token fill "
                  f"{fill[name]:.2f}", flush=True)
    return {name: {"median_step_s": statistics.median(times[name]), "token_fill": fill[name],
                   "runs": times[name]} for name in runs} | {
        "ratio": statistics.median(b / a for a, b in zip(times["caps"], times["2x caps"]))}


def bench_partitions(work: str, setup: dict, steps: int, repeats: int) -> dict:
    """The profiled search's partition, DeepSpeed's, and the one a run takes when it names none
    (``analytic``: the search over the model's analytic costs), modelled with the profile."""
    from vlmshard.partition import LayerCost, Machine, evaluate
    from vlmshard.run_log import stage_bounds
    from vlmshard.train.profile import describe

    partitions = read_json(os.path.join(setup["profile"], "partition.json"))
    names = [n for n in ("search", "parameters", "uniform") if partitions[n]] + ["analytic"]
    times = {name: [] for name in names}
    errors = []
    for i in range(repeats):
        for name in names:
            cfg = TrainConfig(shards=setup["shards"]["balanced"], model=setup["model"], pp=2,
                              dp=1, max_steps=steps, save_checkpoints=False,
                              out=os.path.join(work, "runs", f"pp-{name}-{i}"))
            if name != "analytic":
                cfg.use_partition(partitions[name])
            summary = summarize(train_and_read_log(cfg), cfg.out, setup["profile"])
            times[name].append(summary["median_step_s"])
            errors.append(summary["simulated_median_step_error"])
            print(f"  pp=2 {name:<10} repeat {i}: {times[name][-1]:.3f} s/step", flush=True)
            if name == "analytic" and i == 0:  # as the profile models it
                bounds = stage_bounds(read_json(os.path.join(cfg.out, "pipeline.json"))["stages"])
                layers = [LayerCost.from_dict(c) for c in read_json(
                    os.path.join(setup["profile"], "profile.json"))["layers"]]
                modelled = evaluate(layers, bounds, Machine(**partitions["machine"]))
                partitions[name] = describe(modelled, layers, name)
    result = {name: {"bounds": partitions[name]["bounds"],
                   "recompute": [r for s in partitions[name]["stages"] for r in s["recompute"]],
                   "modelled_max_stage_s": partitions[name]["max_stage_s"],
                   "median_step_s": statistics.median(times[name]),
                   "vs_search": statistics.median(t / s for t, s in
                                                  zip(times[name], times["search"])),
                   "runs": times[name]}
              for name in names}
    result["simulated_median_step_error"] = statistics.median(errors)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", default=os.path.join(REPO, "build", "bench", "train"))
    parser.add_argument("--scale", type=int, default=1, help="demo dataset scale")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dp-steps", type=int, default=10,
                        help="steps per dp=2 run, the first untimed (0: the whole epoch)")
    parser.add_argument("--steps", type=int, default=6, help="steps per pp=2 partition run")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--model-type", default="internvl",
                        help="the demo model's model_type (internvl, qwen3_vl, ...)")
    parser.add_argument("--memory-budget", default="1TB",
                        help="the profile's device memory: it bounds the balanced plan's caps "
                             "(their search takes the largest caps that fit, and the loader "
                             "pads pixels to them: 1TB is fine for 448-px tiles, far too much "
                             "for a 32-px unit)")
    parser.add_argument("--only", default="balance,padding,partition",
                        help="the measurements to run")
    args = parser.parse_args()
    setup = prepare(args.work, args.scale, args.model_type, args.memory_budget)
    only = set(args.only.split(","))
    result = {"machine": f"{platform.node()} {os.cpu_count()} CPUs, {platform.processor()}",
              "model_type": args.model_type, "plans": setup["plans"]}
    if "balance" in only:
        result["balance"] = bench_balance(args.work, setup, args.dp_steps, args.repeats)
    if "padding" in only:
        result["padding"] = bench_padding(args.work, setup, args.steps, args.repeats)
    if "partition" in only:
        result["partition"] = bench_partitions(args.work, setup, args.steps, args.repeats)
    if "balance" in result:
        balance = result["balance"]
        print(f"\n{'dp=2 plan':<10} {'tokens/s':>9} {'max wait':>9} {'mean wait':>9} "
              f"{'imbalance':>9} {'plan cost eff':>13}")
        for name in ("balanced", "random"):
            b = balance[name]
            print(f"{name:<10} {b['tokens_per_s']:>9.0f} {b['wait_fraction']:>9.3f} "
                  f"{b['mean_wait_fraction']:>9.3f} {b['imbalance_fraction']:>9.3f} "
                  f"{b['predicted_cost_efficiency']:>13.3f}")
        print(f"balanced / random throughput: {balance['throughput_ratio']:.3f}")
    if "padding" in result:
        padding = result["padding"]
        print(f"\n{'same batches':<13} {'token fill':>10} {'step s':>8}")
        for name in ("caps", "2x caps"):
            print(f"{name:<13} {padding[name]['token_fill']:>10.2f} "
                  f"{padding[name]['median_step_s']:>8.3f}")
        print(f"step time at 2x caps / at caps: {padding['ratio']:.3f}")
    if "partition" in result:
        print(f"\n{'pp=2 partition':<15} {'bounds':<16} {'modelled s':>10} {'step s':>8} "
              f"{'/ search':>8}")
        for name, p in result["partition"].items():
            if name == "simulated_median_step_error":
                continue
            print(f"{name:<15} {str(p['bounds']):<16} {p['modelled_max_stage_s']:>10.3f} "
                  f"{p['median_step_s']:>8.3f} {p['vs_search']:>8.3f}")
    errors = [r["simulated_median_step_error"] for name in ("balanced", "random")
              for r in result["balance"][name]["runs"]] if "balance" in result else []
    parts = ([f"{statistics.median(errors):.1%} (dp=2 runs)"] if errors else []) + (
        [f"{result['partition']['simulated_median_step_error']:.1%} (pp=2 runs)"]
        if "partition" in result else [])
    print("\nsimulator (measured layer times) vs measured step times: median per-step error "
          + ", ".join(parts))
    if args.json:
        write_json_atomic(args.json, result)


if __name__ == "__main__":
    main()
