"""Offline balance against runtime re-balancing, held out: ``vlmshard simulate --compare``'s seven
strategies on data sets the packer was not tuned on, at 8, 64 and 1,024 data-parallel ranks.

    python benchmarks/runtime_bench.py --ranks 8 64    # about a minute on 2 vCPUs
    python benchmarks/runtime_bench.py                 # 1,024 ranks too: over 10 minutes
    python benchmarks/runtime_bench.py --ranks 8 64 --cost-error none noise=0.1 vit=0.3,llm=-0.1

Data sets: OmniBal's two released length files (ai2d + docvqa, 22,624 rows, InternVL-Chat-1.5
on H100s, PP 4) resampled to 1,024 samples a rank, and ``video_bench.py``'s video mix (images,
image sets, clips of 2 s to 5 min; Qwen3-VL-8B on H100s, PP 2) and ``hbp_bench.py``'s long-tail
mix (80% short samples, 15% documents of 4k-16k tokens, 5% clips of 16k-64k; Qwen3-VL-8B, PP 4,
each sample whole on one rank: the runtime strategies split none) drawn at the same count. Each is
packed ``balanced`` for the ranks with 8 micro-batches a rank a step (the packer's defaults
otherwise), then simulated as packed; the random, runtime and offline strategies all
place the same samples. Prints a Markdown table for BENCHMARKS.md: GPU-days, DP waiting, the
runtime strategies' exchange and planning shares, and each strategy's GPU-days over balanced's.

``--cost-error`` times every strategy at true costs that depart from the model the plans were
packed with (``simulate/cost_error.py``; ``none``: exact, or ``noise=X,vit=X,llm=X,seed=N``),
each plan packed once and simulated under each; with more than one, a second table: per error,
balanced's GPU-days over its own under the first error given, and every strategy's over
balanced's.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

BENCH = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCH)
sys.path.insert(0, REPO)
sys.path.insert(0, BENCH)

from hbp_bench import long_tail  # noqa: E402
from pack_bench import DATA, real_lengths, resample  # noqa: E402
from video_bench import video_mix  # noqa: E402

from vlmshard.families import presets  # noqa: E402
from vlmshard.packing.config import PackConfig  # noqa: E402
from vlmshard.packing.cost import CostModel  # noqa: E402
from vlmshard.packing.plan import run_pack  # noqa: E402
from vlmshard.simulate.config import SimulateConfig  # noqa: E402
from vlmshard.simulate.cost_error import CostError  # noqa: E402
from vlmshard.simulate.runs import run_simulate  # noqa: E402

SAMPLES_PER_RANK = 1024
DATASETS = {  # name: (lengths for n samples, model preset, pipeline stages)
    "omnibal": (lambda n: resample(real_lengths(DATA), n), "internvl-chat-1.5", 4),
    "video-mix": (lambda n: resample(video_mix(4 * n)[0], n), "qwen3-vl-8b", 2),
    "long-tail": (lambda n: long_tail(n, seed=0), "qwen3-vl-8b", 4),
}
ORDER = ("random", "lengthgroup", "isf", "balanced", "orchmllm", "veomni-vit", "loongforge")


def write_lengths(path: str, lengths) -> str:
    rows = [{"vit_num": int(v), "token_num": int(t)}
            for v, t in zip(lengths.tiles, lengths.tokens)]
    with open(path, "w", encoding="utf-8") as f:
        json.dump(rows, f)
    meta = path + ".meta.json"
    with open(meta, "w", encoding="utf-8") as f:
        json.dump({"rows": {"token_lengths": os.path.abspath(path)}}, f)
    return meta


def cost_error(spec: str) -> CostError:
    """``none``, or ``noise=0.1,vit=0.3,seed=1``: a ``CostError``."""
    if spec == "none":
        return CostError()
    fields = dict(item.split("=") for item in spec.split(","))
    return CostError(**{k: int(v) if k == "seed" else float(v) for k, v in fields.items()})


def run(work: str, name: str, ranks: int, errors: list[str]) -> dict:
    """Per cost error spec, the simulation of one data set packed for ``ranks``."""
    draw, model, pp = DATASETS[name]
    meta = write_lengths(os.path.join(work, f"{name}-{ranks}.json"), draw(SAMPLES_PER_RANK * ranks))
    plan = os.path.join(work, f"plan-{name}-{ranks}")
    # a length file counts InternVL's units; the model's own cost model says what a unit costs
    cost = os.path.join(work, f"cost-{model}.json")
    with open(cost, "w", encoding="utf-8") as f:
        json.dump(CostModel.from_sizes(presets()[model]).to_dict(), f)
    run_pack(PackConfig(stats=meta, dp=ranks, out=plan, cost_model=cost, micro_batches=8))
    out = {}
    for spec in errors:
        start = time.perf_counter()
        result = run_simulate(SimulateConfig(plan=plan, model=model, gpu="h100", pp=pp,
                                             cost_error=cost_error(spec)))
        out[spec] = {"seconds": time.perf_counter() - start,
                     "strategies": result["strategies"]}
    return out


def error_markdown(results: dict, errors: list[str]) -> str:
    """Per data set, scale and cost error: balanced's GPU-days, over its own under the first
    error given (the exact model), and every other strategy's over balanced's."""
    others = [a for a in ORDER if a != "balanced"]
    lines = ["| data | ranks | true cost | balanced GPU-days | ÷ exact | "
             + " | ".join(others) + " |", "|---|---:|---|---:|---:|" + "---:|" * len(others)]
    for (name, ranks), by_error in results.items():
        exact = by_error[errors[0]]["strategies"]["balanced"]["gpu_days"]
        for spec in errors:
            s = by_error[spec]["strategies"]
            base = s["balanced"]["gpu_days"]
            ratios = [f"{s[a]['gpu_days'] / base:.3f}" if "error" not in s[a] else "–"
                      for a in others]
            lines.append(f"| {name} | {ranks} | {spec} | {base:.4g} | {base / exact:.3f} | "
                         + " | ".join(ratios) + " |")
    return "\n".join(lines)


def markdown(results: dict) -> str:
    lines = ["| data | ranks | strategy | GPU-days | DP waiting | exchange | planning | "
             "÷ balanced |", "|---|---:|---|---:|---:|---:|---:|---:|"]
    for (name, ranks), r in results.items():
        base = r["strategies"]["balanced"].get("gpu_days")
        for algo in ORDER:
            s = r["strategies"][algo]
            if "error" in s:
                lines.append(f"| {name} | {ranks} | {algo} | does not fit | | | | |")
                continue
            runtime = (f"{s['exchange_share']:.2%} | {s['planning_share']:.2%}"
                       if "exchange_share" in s else "– | –")
            ratio = f"{s['gpu_days'] / base:.3f}" if base else "–"
            lines.append(f"| {name} | {ranks} | {algo} | {s['gpu_days']:.4g} | "
                         f"{s['waiting_fraction']:.1%} | {runtime} | {ratio} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", default=os.path.join(REPO, "build", "bench", "runtime"))
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 64, 1024])
    parser.add_argument("--data", nargs="+", default=list(DATASETS), choices=list(DATASETS))
    parser.add_argument("--cost-error", nargs="+", default=["none"], metavar="SPEC",
                        help="true costs against the model: none, or noise=X,vit=X,llm=X,seed=N "
                             "(several: one simulation each, and the cost-error table)")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    os.makedirs(args.work, exist_ok=True)
    results = {}
    for name in args.data:
        for ranks in args.ranks:
            results[name, ranks] = run(args.work, name, ranks, args.cost_error)
            seconds = sum(r["seconds"] for r in results[name, ranks].values())
            print(f"{name} at {ranks} ranks: simulated in {seconds:.0f} s", file=sys.stderr)
    print(f"machine: {platform.node()}, {os.cpu_count()} CPUs, python {platform.python_version()}")
    print(markdown({k: v[args.cost_error[0]] for k, v in results.items()}))
    if len(args.cost_error) > 1:
        print()
        print(error_markdown(results, args.cost_error))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({f"{k[0]}@{k[1]}": v for k, v in results.items()}, f, indent=1)


if __name__ == "__main__":
    main()
