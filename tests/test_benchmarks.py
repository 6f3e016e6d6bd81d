"""Every benchmark script imports and answers ``--help`` (``make bench`` runs them; a script
broken by a moved module would otherwise be found only an hour into the benchmarks)."""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys

import pytest
from helpers import REPO

SCRIPTS = sorted(glob.glob(os.path.join(REPO, "benchmarks", "*.py")))


def test_make_bench_runs_scripts_that_exist():
    with open(os.path.join(REPO, "Makefile"), encoding="utf-8") as f:
        named = re.findall(r"benchmarks/(\w+\.py)", f.read())
    assert named and {os.path.join(REPO, "benchmarks", n) for n in named} <= set(SCRIPTS)


@pytest.mark.parametrize("script", SCRIPTS, ids=os.path.basename)
def test_benchmark_script_prints_its_usage(script, tmp_path):
    """Run from another folder, as ``python benchmarks/x.py`` would be from anywhere."""
    proc = subprocess.run([sys.executable, script, "--help"], capture_output=True, text=True,
                          cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"usage: {os.path.basename(script)}"), proc.stdout


@pytest.mark.slow(minutes=4)
@pytest.mark.timeout(2400)
def test_gpu_bench_smoke_runs_the_gpu_path_on_cpu(tmp_path):
    """``gpu_bench.py --smoke``: the GPU command's whole path on CPU with a tiny model: data,
    both plans packed, the balanced one trained (``--plans``: the random one trains through the
    same code), the loader alone, DeepSpeed runs, the profile, and every figure filled from
    them. The simulator's replay of each step comes with its error against the measured step.
    Of 4 steps of 2 micro-batches, the first (warm-up) and the second (traced by the profiler)
    are left out.
    The Hugging Face ``Trainer`` peers (``--baseline``) train the same steps: packed on
    ``TORCH_VARLEN`` (flash-attn's convention; here each sample on SDPA) and padded per
    sample, on vlmshard's rank's threads and kernels, each losing at its first step what
    vlmshard's first step lost, within 1e-4."""
    import json
    from collections import Counter

    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "gpu_bench.py"),
                           "--smoke", "--work", str(tmp_path / "work"), "--json", str(out),
                           "--peak-tflops", "1", "--steps", "4", "--target-samples", "2",
                           "--micro-batches", "2", "--plans", "balanced", "--baseline", "--trace",
                           str(tmp_path / "trace")],
                          capture_output=True, text=True, timeout=2100)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert json.dumps(result) in proc.stdout.splitlines()
    assert result["attention"] == "sdpa" and result["loader"]["tokens_per_s"] > 0
    assert "random" not in result
    assert result["caps"] == result["random_caps"]  # --target-samples: balanced under random's
    assert (f"micro-batches: balanced up to {result['caps']['max_qv']:,} tiles and "
            f"{result['caps']['max_qt']:,} tokens; random 2 samples") in proc.stdout
    run = result["balanced"]
    assert run["steps"] == 2 and 0 < run["median_step_s"] <= run["p90_step_s"]
    assert run["tokens_per_s"] > 0 and run["tiles_per_s"] > 0 and 0 < run["mfu"] < 1
    assert run["partition"].startswith("searched") and run["recompute"] == []
    assert run["attention"] == "sdpa"  # the backend the run's pipeline.json records
    assert run["predicted_step_s"] > 0 and len(run["replay_step_error"]) == run["steps"]
    assert f"{'balanced':<22} {run['median_step_s']:>9.3f}" in proc.stdout
    # the memory model at the caps bounds it at the micro-batches that ran
    assert 0 < run["predicted_step_peak_bytes"] <= run["predicted_peak_bytes"]
    # where the time went: each part measured apart, together the step with its loading
    parts = run["time_breakdown"]
    assert set(parts) == {"vit", "projector", "llm", "head", "recompute", "optimizer",
                          "pipeline_wait", "data_wait", "other"}
    assert min(parts.values()) >= 0 and min(parts[p] for p in ("vit", "projector", "llm",
                                                               "head", "optimizer")) > 0
    assert sum(parts.values()) == pytest.approx(run["breakdown_step_s"], rel=0.05)
    # the host's time per part: on CPU the device is the host, so the same intervals
    host = run["host_breakdown"]
    assert set(host) == {"vit", "projector", "llm", "head", "recompute", "optimizer"}
    assert host == pytest.approx({p: parts[p] for p in host}, rel=1e-6)
    assert run["allocator_calls"] == {}  # a GPU's
    assert f"balanced the host launching: vit {host['vit']:.3f}" in proc.stdout
    assert run["hfu"] >= run["mfu"]
    trace = tmp_path / "trace" / "balanced" / "trace-rank0-step1.json"
    with open(trace, encoding="utf-8") as f:
        events = json.load(f)["traceEvents"]
    # every layer ran in its range (what charges a GPU trace's kernels to the parts), the
    # recomputed ones twice
    ranges = Counter(e["name"] for e in events if e.get("cat") == "user_annotation"
                     and e["name"].startswith("vlmshard::"))
    run_folder = tmp_path / "work" / "run-balanced"
    traced = json.loads((run_folder / "train_log.jsonl").read_text().splitlines()[1])
    micro_batches = sum(len(d["micro_sizes"]) for d in traced["data"])
    # its Qwen3-VL ViT attends across each image: 12 × its width per squared patch count of an
    # image (forward and backward, in every block), a share of each step's model FLOPs
    vision = json.loads((tmp_path / "work" / "model" / "config.json").read_text())[
        "vision_config"]
    per_square = 12 * vision["hidden_size"] * vision["depth"]
    logged = [json.loads(line) for line in
              (run_folder / "train_log.jsonl").read_text().splitlines()]
    kept = [r for r in logged if r["step"] in run["kept_steps"]]
    seconds = sum(r["step_time_s"] for r in kept)
    # every rate over the kept steps a sum over a sum (not a median of per-step ratios)
    assert run["mfu"] == pytest.approx(sum(r["model_flops"] for r in kept) / seconds / 1e12,
                                       rel=1e-9)
    assert run["hfu"] == pytest.approx(sum(r["hardware_flops"] for r in kept) / seconds / 1e12,
                                       rel=1e-9)
    assert run["tokens_per_s"] == pytest.approx(sum(r["tokens"] for r in kept) / seconds,
                                                rel=1e-9)
    vit_flops = sum(per_square * sum(m["vit_squares"] for d in r["data"] for m in d["micro_sizes"])
                    for r in kept)
    assert run["vit_attention_share"] == pytest.approx(
        vit_flops / sum(r["model_flops"] for r in kept), rel=1e-9)
    assert 0 < run["vit_attention_share"] < 1
    assert f"balanced: its MFU counts the ViT's attention across each image, " \
        f"{run['vit_attention_share']:.1%}" in proc.stdout
    # in the anchors' convention, causal attention as the full square: each full-attention
    # layer's QKᵀ and AV, 2 × 2·q FLOPs per squared sample length forward, 3× with backward,
    # where the MFU counts the half the causal kernel computes (peak: --peak-tflops 1)
    text = json.loads((tmp_path / "work" / "model" / "config.json").read_text())["text_config"]
    assert set(text.get("layer_types") or ["full_attention"]) == {"full_attention"}
    half = 6 * text["num_attention_heads"] * text["head_dim"] * text["num_hidden_layers"]
    full = sum(r["model_flops"] + half * sum(m["squares"] for d in r["data"]
                                             for m in d["micro_sizes"]) for r in kept)
    assert run["mfu_full_attention"] == pytest.approx(full / seconds / 1e12, rel=1e-9)
    assert run["mfu"] < run["mfu_full_attention"] < 2 * run["mfu"]
    assert f"balanced: MFU {run['mfu_full_attention']:.1%} with the LLM's causal attention " \
        "counted as the full square" in proc.stdout
    for stage in json.loads((run_folder / "pipeline.json").read_text())["stages"]:
        for name in stage["layers"]:
            again = name in stage["recompute"] or name in stage["selective"]
            assert ranges[f"vlmshard::{name}"] == micro_batches * (1 + again), (name, ranges)
    # its summary (no device work on CPU), and the counted synchronize calls' sites
    assert run["trace"]["file"] == str(trace)
    assert run["trace"]["device_span_s"] == 0
    assert sum(run["host_sync_sites"].values()) == run["host_syncs_per_step"]
    # the step after the traced one, sampled: where its host time went, by function
    sites = run["trace"]["host_sites"]
    assert 0 < sum(sites["seconds"].values()) <= sites["sampled_s"] * 1.01
    assert any("models/" in site for site in sites["seconds"])  # the layers' own forwards
    # the peers: the same samples, the same first-step loss
    from vlmshard.shards.model_inputs import TORCH_VARLEN

    peers = result["baseline"]
    assert peers["hf_packed"]["attention"] == TORCH_VARLEN
    assert peers["hf_padded"]["attention"] == "sdpa"
    from vlmshard.train.trainer import cpu_threads_per_rank

    for peer in peers.values():  # no gradient checkpointing where memory does not need it
        assert len(peer["loss"]) == 4 and peer["tokens_per_s"] > 0 and 0 < peer["mfu"] < 1
        assert peer["gradient_checkpointing"] is False and peer["split"] == 1
        # configured on what a vlmshard CPU rank takes: its threads, Conv3d patches, no Liger
        assert peer["threads"] == cpu_threads_per_rank(1)
        assert peer["liger"] is False and peer["patch_linear"] is False
        assert peer["loss"][0] == pytest.approx(run["loss"][0], rel=1e-4)
    # the ViT's and the LLM's blocks ran at a measured rate, below the given 1 TFLOP/s
    assert {"vit_block", "llm_block"} <= set(result["sustained_share"])
    assert all(0 < share < 1 for share in result["sustained_share"].values())


def test_layer_kinds_bench_costs_less_attention_by_kind(tmp_path):
    """Under the by-kind cost model attention is no larger a share of any mix's work than an
    all-attention FLOPs model claims, and smaller wherever linear-attention layers or samples
    past Gemma 3's window are; Qwen3.5's plans are the same either way (``balanced``
    weighs each sample's quadratic work against the window's mean, whatever scales it)."""
    import json

    out = tmp_path / "kinds.json"
    proc = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks",
                                                        "layer_kinds_bench.py"),
                           "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(out.read_text())["rows"]
    pairs = {}
    for row in rows:
        pairs.setdefault((row["model"], row["mix"]), {})[row["packed_with"]] = row
    assert len(pairs) == 10
    for (model, mix), pair in pairs.items():
        kind, full = pair["by kind"], pair["all attention"]
        assert kind["attention_share"] <= full["attention_share"]
        if model.startswith("qwen3.5") or mix == "text-heavy":
            assert kind["attention_share"] < full["attention_share"]
        if model.startswith("qwen3.5"):
            assert (kind["qt"], kind["step_efficiency"]) == (full["qt"], full["step_efficiency"])


@pytest.mark.slow
def test_video_bench_balances_videos_and_probes_without_decoding(tmp_path):
    """``video_bench.py`` on a small mix: balanced places every sample and beats random and
    isf at its own caps on step_efficiency with videos in the mix; probing a clip takes less
    than decoding all its frames, and the gap grows with the clip."""
    import json

    out = tmp_path / "video.json"
    proc = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "video_bench.py"),
                           "--samples", "1500", "--repeats", "1", "--clips", "2,8",
                           "--json", str(out)], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    runs = result["packing"]["runs"]
    for micro in (1, 4):
        run = {algo: runs[f"M={micro} with video {algo}"]
               for algo in ("random", "isf at balanced's caps", "balanced")}
        assert run["balanced"]["unplaced"] == 0
        assert run["balanced"]["step_efficiency"] > run["isf at balanced's caps"][
            "step_efficiency"] > run["random"]["step_efficiency"]
    short, long = result["probe"]["2 s"], result["probe"]["8 s"]
    assert long["frames"] == 240 and long["probe_ms"] < long["decode_all_ms"]
    assert long["decode_all_ms"] / long["probe_ms"] > short["decode_all_ms"] / short["probe_ms"]


@pytest.mark.slow
def test_host_path_bench_smoke_recomputes_every_block_in_backward(tmp_path):
    """``host_path_bench.py --smoke``: 2 ViT and 2 LLM blocks on a loader micro-batch, each plan
    timed and its ops counted. Recomputing every block whole runs each block's forward again in
    backward: the backward dispatches at least those blocks' forward ops more than without."""
    import json

    out = tmp_path / "host.json"
    proc = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "host_path_bench.py"),
                           "--smoke", "--json", str(out)], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    plans = result["plans"]
    assert set(plans) == {"none", "full", "selective"}
    assert all(plan["host_ms"] > 0 for plan in plans.values())
    per_layer = plans["none"]["forward_ops_per_layer"]
    blocks = 2 * per_layer["vit_block"] + 2 * per_layer["llm_block"]
    assert plans["full"]["whole"] == plans["selective"]["selective"] == 4
    assert plans["full"]["ops_backward"] - plans["none"]["ops_backward"] >= blocks
    assert result["outside_ops_ms"]["text_rope"] > 0


def test_loss_bench_smoke_counts_one_logits_matmul_fewer(tmp_path):
    """``loss_bench.py --smoke``: the fused loss runs three matmuls of the logits' size (logits,
    both gradients) where the recomputed one runs four (the logits again in backward): FLOPs
    3/4 of it, by ``FlopCounterMode``; and it holds no more at once."""
    import re

    proc = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "loss_bench.py"),
                           "--smoke"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ratios = dict(re.findall(r"(\w+) ([\d.]+)", proc.stdout.splitlines()[-1].split(":", 1)[1]))
    assert float(ratios["FLOPs"]) == 0.75
    assert float(ratios["held"]) <= 1.0
