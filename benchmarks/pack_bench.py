"""Packing quality and speed on OmniBal's real InternVL-1.2M length statistics.

    python benchmarks/pack_bench.py                    # everything (about 2 minutes)
    python benchmarks/pack_bench.py --skip-speed       # only the quality tables (+ command)

Quality: all four algorithms on the real rows (ai2d + docvqa, 22,624 samples) at R=8 M=1,
R=64 M=1 and R=8 M=4, automatic caps (ISF: OmniBal's search), default seed.
Speed: ``balanced`` including automatic caps on 1.2M and 10M samples resampled from those rows,
each size in a fresh process pinned to one core (peak RSS of that process); our ``isf`` grouping
against OmniBal's pure-Python ISF logic on the same 1.2M samples and caps. Medians of repeats.
Command: the whole ``vlmshard pack`` process on the real rows against its own pack_seconds.
Caps matrix: per data mix (``tests/length_mixes.py``, 200k samples per synthetic mix) and compute
mode, ``isf`` on OmniBal's searched caps against ``balanced`` searching its caps inside them.
Prints Markdown for BENCHMARKS.md; ``--json`` also writes the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from vlmshard.packing import algorithms  # noqa: E402
from vlmshard.packing.batches import Lengths  # noqa: E402
from vlmshard.families import presets  # noqa: E402
from vlmshard.packing.cost import CostModel  # noqa: E402
from vlmshard.packing.config import ALGORITHMS, PADDED, PackConfig  # noqa: E402
from vlmshard.packing.plan import choose_caps, pack_epoch  # noqa: E402
from vlmshard.packing.metrics import measure  # noqa: E402
from vlmshard.packing.stats import load_stats  # noqa: E402

sys.path.insert(0, os.path.join(REPO, "tests"))
from references import isf_groups_reference  # noqa: E402  (OmniBal's ISF, the speed baseline)
from length_mixes import MIXES, mix  # noqa: E402  (the caps matrix's data mixes)

DATA = os.path.join(REPO, "..", "shared", "data", "omnibal-lengths")
FILES = ("ai2d_train_12k.json", "docvqa_train_10k.json")
COST = CostModel.from_sizes(presets()["internvl2-2b"])
SETTINGS = ((8, 1), (64, 1), (8, 4))
COLUMNS = ("vit_dist_ratio", "llm_dist_ratio", "attn_dist_ratio", "vit_fill", "llm_fill",
           "pad_ratio", "cost_efficiency", "order_spearman", "source_mix_tv", "qv", "qt",
           "steps", "unplaced", "pack_seconds")


def real_lengths(data_dir: str) -> Lengths:
    meta = os.path.join(os.environ.get("TMPDIR", "/tmp"), "vlmshard-omnibal-meta.json")
    with open(meta, "w") as f:
        json.dump({os.path.splitext(n)[0]: {"token_lengths": os.path.abspath(
            os.path.join(data_dir, n))} for n in FILES}, f)
    return load_stats(meta).lengths


def resample(lengths: Lengths, n: int, seed: int = 0) -> Lengths:
    return lengths.take(np.random.default_rng(seed).integers(0, len(lengths), n))


def plan(lengths: Lengths, algo: str, ranks: int, micro: int, seed: int = 0,
         mode: str = "padding-free", cost: CostModel = COST, **bound):
    """Caps (automatic or searched, inside ``bound``: max_qv, max_qt) + one epoch + metrics
    (the trainer computing in ``mode``; ``cost``: the model's), timed like ``vlmshard pack``."""
    cfg = PackConfig(stats="-", dp=ranks, out="-", micro_batches=micro, algo=algo, seed=seed,
                     compute_mode=mode, **bound)
    t0 = time.perf_counter()
    caps, _, _ = choose_caps(cfg, lengths, cost)
    packing = pack_epoch(cfg, lengths, caps, cost, seed=seed)
    seconds = time.perf_counter() - t0
    return measure(lengths, packing, qv=caps.qv, qt=caps.qt, cost=cost,
                   padded=algo in PADDED, dp=ranks, pack_seconds=seconds, mode=mode)


def quality(lengths: Lengths) -> dict:
    plan(lengths.take(np.arange(2000)), "balanced", 8, 1)  # compile the kernels first
    out = {}
    for ranks, micro in SETTINGS:
        for algo in ALGORITHMS:
            out[f"R={ranks} M={micro} {algo}"] = {
                **plan(lengths, algo, ranks, micro).to_dict(),
                "step_efficiency_padded": plan(lengths, algo, ranks, micro,
                                               mode="padded").step_efficiency}
    # R=64 has only 90 steps on the real rows; at 1.2M samples each step has more to match.
    big = resample(lengths, 1_200_000)
    for algo in ("balanced", "isf"):
        out[f"R=64 M=1 1.2M-resampled {algo}"] = plan(big, algo, 64, 1).to_dict()
    return out


MATRIX_SAMPLES = 200_000  # per synthetic mix; the real files give their own rows


def caps_matrix() -> dict:
    """Per data mix and compute mode, R=8 M=1: isf on OmniBal's searched caps against balanced
    searching its caps inside those (equal memory)."""
    out = {}
    for name in MIXES:
        lengths = mix(name, MATRIX_SAMPLES)
        for mode in ("padded", "padding-free"):
            isf = plan(lengths, "isf", 8, 1, mode=mode)
            bal = plan(lengths, "balanced", 8, 1, mode=mode, max_qv=isf.qv, max_qt=isf.qt)
            out[f"{name} {mode}"] = {"samples": len(lengths), "isf": isf.to_dict(),
                                     "balanced": bal.to_dict(),
                                     "ratio": bal.step_efficiency / isf.step_efficiency}
    return out


def markdown_matrix(results: dict) -> str:
    lines = ["| mix | mode | samples | isf Qv/Qt | isf step_eff | isf fills V/L | isf unplaced | "
             "balanced Qv/Qt | balanced step_eff | balanced fills V/L | balanced unplaced | "
             "balanced / isf |", "|" + "---|" * 12]
    for key, r in results.items():
        name, mode = key.rsplit(" ", 1)
        i, b = r["isf"], r["balanced"]
        lines.append(
            f"| {name} | {mode} | {r['samples']:,} | {i['qv']}/{i['qt']} | "
            f"{i['step_efficiency']:.4f} | {i['vit_fill']:.3f}/{i['llm_fill']:.3f} | "
            f"{i['unplaced']} | {b['qv']}/{b['qt']} | {b['step_efficiency']:.4f} | "
            f"{b['vit_fill']:.3f}/{b['llm_fill']:.3f} | {b['unplaced']} | {r['ratio']:.3f}x |")
    return "\n".join(lines)


def speed_child(n: int, repeats: int, data_dir: str) -> dict:
    """Runs in a fresh process pinned to one core: balanced (auto caps) on n resampled samples."""
    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    lengths = resample(real_lengths(data_dir), n)
    plan(lengths.take(np.arange(2000)), "balanced", 8, 1)  # compile
    times, m = [], None
    for _ in range(repeats):
        m = plan(lengths, "balanced", 8, 1)
        times.append(m.pack_seconds)
    return {"samples": n, "seconds": times, "median_seconds": statistics.median(times),
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "metrics": m.to_dict()}


def isf_vs_omnibal(lengths: Lengths, repeats: int) -> dict:
    """Our ISF grouping against OmniBal's pure-Python logic: same samples, caps, seed, T=50."""
    cfg = PackConfig(stats="-", dp=8, out="-", algo="isf")
    caps, _, _ = choose_caps(cfg, lengths.take(np.arange(min(len(lengths), 200_000))), COST)
    ids = algorithms.split_over_cap(lengths, caps)[0]
    algorithms.isf_groups(lengths.take(np.arange(1000)), np.arange(1000), caps, seed=0)
    ours = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        items, group = algorithms.isf_groups(lengths, ids, caps, seed=0)
        ours.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    ref = isf_groups_reference(lengths.tiles, lengths.tokens, ids, caps.qv, caps.qt, seed=0)
    reference = time.perf_counter() - t0
    same = len(ref) == int(group[-1]) + 1 and all(
        a == b for a, b in zip((i for g in ref for i in g), items.tolist()))
    return {"samples": len(ids), "qv": caps.qv, "qt": caps.qt, "ours_seconds": ours,
            "ours_median": statistics.median(ours), "omnibal_python_seconds": reference,
            "speedup": reference / statistics.median(ours), "identical_groups": same}


def command_overhead(data_dir: str, repeats: int) -> dict:
    """The whole ``vlmshard pack`` command (a fresh process: imports, kernel load, reading the
    lengths, packing, metrics, writing the plan) against its own ``pack_seconds``, and the whole
    ``vlmshard pack --algo isf`` command against a fresh process running OmniBal's ISF grouping
    (its Python logic, ``references.isf_groups_reference``) on the same rows at the caps our ISF
    chose, and the same command on Numba's JIT (its on-disk cache warm: the kernels before they
    were compiled ahead of time), runs interleaved. The overhead beyond packing is held to 0.5 s."""
    import tempfile

    meta = os.path.join(os.environ.get("TMPDIR", "/tmp"), "vlmshard-omnibal-meta.json")
    real_lengths(data_dir)  # writes the meta file naming both length files
    vlmshard = os.path.join(os.path.dirname(sys.executable), "vlmshard")

    # no cache folder can be made under /dev/null: the kernels fall back to Numba's JIT
    jit_env = {**os.environ, "VLMSHARD_KERNEL_CACHE": "/dev/null/jit"}

    def command(*extra: str, env: dict | None = None) -> tuple[float, dict]:
        """Wall seconds and the JSON result, with ``cpu_seconds`` (user + system) added: on a
        shared machine the CPU time is what the command itself costs."""
        with tempfile.TemporaryDirectory() as out:
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            t0 = time.perf_counter()
            proc = subprocess.run([vlmshard, "-q", "pack", "--stats", meta, "--dp", "8", "--out",
                                   out, "--json", *extra], capture_output=True, text=True,
                                  check=True, env=env)
            wall = time.perf_counter() - t0
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            result = json.loads(proc.stdout)
            result["cpu_seconds"] = (after.ru_utime - before.ru_utime
                                     + after.ru_stime - before.ru_stime)
            return wall, result

    command()  # the first runs after a change compile the kernels (once per machine)
    command(env=jit_env)
    walls, packs, cpus, jit_walls, jit_packs, isf_walls, omnibal_walls = ([] for _ in range(7))
    for _ in range(repeats):
        wall, metrics = command()
        walls.append(wall)
        packs.append(metrics["pack_seconds"])
        cpus.append(metrics["cpu_seconds"])
        wall, metrics = command(env=jit_env)
        jit_walls.append(wall)
        jit_packs.append(metrics["pack_seconds"])
        wall, isf = command("--algo", "isf")
        isf_walls.append(wall)
        script = (f"import json, os, sys; sys.path.insert(0, {os.path.join(REPO, 'tests')!r}); "
                  "from references import isf_groups_reference as isf; rows = [r for n in "
                  f"{list(FILES)!r} for r in json.load(open(os.path.join(sys.argv[1], n)))]; "
                  "isf([r['vit_num'] for r in rows], [r['token_num'] for r in rows], "
                  f"list(range(len(rows))), {isf['qv']}, {isf['qt']}, seed=0)")
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", script, data_dir], check=True)
        omnibal_walls.append(time.perf_counter() - t0)
    wall, pack = statistics.median(walls), statistics.median(packs)
    return {"command_seconds": walls, "pack_seconds": packs, "median_command_seconds": wall,
            "median_pack_seconds": pack, "overhead_seconds": wall - pack,
            "command_cpu_seconds": cpus, "median_command_cpu_seconds": statistics.median(cpus),
            "within_budget": wall - pack <= 0.5, "jit_command_seconds": jit_walls,
            "jit_pack_seconds": jit_packs,
            "jit_ratio": statistics.median(jit_walls) / wall, "isf_command_seconds": isf_walls,
            "omnibal_isf_process_seconds": omnibal_walls,
            "isf_speedup": statistics.median(omnibal_walls) / statistics.median(isf_walls)}


def markdown_quality(results: dict) -> str:
    head = "| setting | algo | " + " | ".join(COLUMNS) + " |"
    lines = [head, "|" + "---|" * (len(COLUMNS) + 2)]
    for key, m in results.items():
        setting, algo = key.rsplit(" ", 1)
        cells = [f"{m[c]:.4f}" if isinstance(m[c], float) else str(m[c]) for c in COLUMNS]
        lines.append(f"| {setting} | {algo} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", default=DATA, help="folder with OmniBal's length files")
    p.add_argument("--sizes", type=float, nargs="+", default=[1.2e6, 1e7])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--skip-speed", action="store_true")
    p.add_argument("--skip-quality", action="store_true")
    p.add_argument("--skip-command", action="store_true")
    p.add_argument("--skip-matrix", action="store_true")
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(speed_child(args.child, args.repeats, args.data)))
        return 0
    results = {"machine": f"{platform.processor() or platform.machine()}, "
                          f"{len(os.sched_getaffinity(0))} CPUs, "
                          f"Python {platform.python_version()}"}
    lengths = real_lengths(args.data)
    if not args.skip_quality:
        results["quality"] = quality(lengths)
        print(f"## Quality on the real rows ({len(lengths):,} samples)\n")
        print(markdown_quality(results["quality"]), "\n")
        print("## step_efficiency by compute mode\n\n| setting | algo | padding-free | padded |"
              "\n|---|---|---|---|")
        for name, m in results["quality"].items():
            if "step_efficiency_padded" in m:
                setting, algo = name.rsplit(" ", 1)
                print(f"| {setting} | {algo} | {m['step_efficiency']:.4f} | "
                      f"{m['step_efficiency_padded']:.4f} |")
        print()
    if not args.skip_matrix:
        results["matrix"] = caps_matrix()
        print("## Caps matrix: balanced inside isf's searched caps (R=8 M=1)\n")
        print(markdown_matrix(results["matrix"]), "\n")
    if not args.skip_speed:
        results["speed"] = []
        for n in args.sizes:
            out = subprocess.run([sys.executable, __file__, "--child", str(int(n)), "--repeats",
                                  str(args.repeats), "--data", args.data],
                                 capture_output=True, text=True, check=True).stdout
            results["speed"].append(json.loads(out.strip().splitlines()[-1]))
        results["isf"] = isf_vs_omnibal(resample(lengths, int(args.sizes[0])), args.repeats)
        print("## Speed (balanced, automatic caps, one core)\n")
        print("| samples | median s | runs s | peak RSS MB | vit_fill | llm_fill | cost_eff |")
        print("|---|---|---|---|---|---|---|")
        for s in results["speed"]:
            m = s["metrics"]
            print(f"| {s['samples']:,} | {s['median_seconds']:.2f} | "
                  f"{', '.join(f'{t:.2f}' for t in s['seconds'])} | {s['peak_rss_mb']:.0f} | "
                  f"{m['vit_fill']:.4f} | {m['llm_fill']:.4f} | {m['cost_efficiency']:.4f} |")
        i = results["isf"]
        print(f"\nISF grouping, {i['samples']:,} samples, Qv={i['qv']} Qt={i['qt']}, T=50: ours "
              f"{i['ours_median']:.2f} s (median), OmniBal's Python logic "
              f"{i['omnibal_python_seconds']:.1f} s: {i['speedup']:.0f}x; identical groups: "
              f"{i['identical_groups']}")
    if not args.skip_command:
        c = results["command"] = command_overhead(args.data, max(args.repeats, 5))
        print(f"\n## `vlmshard pack` as a command ({len(lengths):,} rows, dp 8)\n")
        print(f"balanced: command median {c['median_command_seconds']:.2f} s (runs "
              f"{', '.join(f'{t:.2f}' for t in c['command_seconds'])}), pack_seconds median "
              f"{c['median_pack_seconds']:.2f} s: overhead {c['overhead_seconds']:.2f} s "
              f"({'within' if c['within_budget'] else 'OVER'} the 0.5 s budget); the command's "
              f"CPU time median {c['median_command_cpu_seconds']:.2f} s")
        print(f"the same on Numba's JIT (warm cache): command median "
              f"{statistics.median(c['jit_command_seconds']):.2f} s, pack_seconds median "
              f"{statistics.median(c['jit_pack_seconds']):.2f} s: {c['jit_ratio']:.2f}x the "
              "compiled kernels' command")
        print(f"isf: command median {statistics.median(c['isf_command_seconds']):.2f} s, "
              f"OmniBal's ISF in a fresh process "
              f"{statistics.median(c['omnibal_isf_process_seconds']):.2f} s: "
              f"{c['isf_speedup']:.1f}x")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
