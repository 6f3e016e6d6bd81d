"""``vlmshard run``: every stage from one config, on the demo dataset, as ``make demo`` runs it."""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest
import yaml

from helpers import REPO, tree_bytes, vlmshard, vlmshard_here
from vlmshard.io import read_json


def _config(tmp_path, out, name: str = "demo.yaml", **changes) -> str:
    with open(os.path.join(REPO, "configs", name), encoding="utf-8") as f:
        config = yaml.safe_load(f)
    config.update(out=str(out), **changes)
    path = tmp_path / f"run-{len(changes)}.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


@pytest.mark.slow(minutes=1.5)
def test_the_qwen3_vl_config_runs_every_stage(tmp_path, capsys):
    """configs/run-qwen3-vl.yaml: a tiny Qwen3-VL through every stage, its 32-px unit costed from
    its own config.json, DeepStack features crossing the configured stage cut."""
    out = tmp_path / "qwen3-vl"
    vlmshard_here("run", "--config", _config(tmp_path, out, "run-qwen3-vl.yaml",
                                             train={"pp": 2, "dp": 1, "max_steps": 2,
                                                    "bounds": [0, 3, 11]}))
    stdout = capsys.readouterr().out
    assert [line.split()[1] for line in stdout.splitlines()[:-1]] == [
        "demo-data", "demo-model", "preprocess", "pack", "write", "verify", "train", "report"]
    assert read_json(out / "model" / "config.json")["model_type"] == "qwen3_vl"
    assert read_json(out / "plan" / "plan.json")["cost_model"]["origin"] == "flops:model"
    stages = read_json(out / "train" / "pipeline.json")["stages"]
    assert stages[0]["layers"] == ["vit_embed", "vit_block_0", "vit_block_1"]
    with open(out / "train" / "train_log.jsonl") as f:
        log = [json.loads(line) for line in f]
    assert len(log) == 2 and all(r["loss"] > 0 for r in log)


# Decimals the README's demo lines hold as the run prints them: to 0.1% (the loss's last digit
# may move with the CPUs' threads); times and measured waiting are left out, they vary
_DECIMAL = re.compile(r"\d+\.\d+")
_VARYING = (re.compile(r"^(\[\d/\d\] \S+)\s+[\d.]+s"), re.compile(r"measured \d\.\d+"))


def _figures(line: str) -> tuple[str, list[float]]:
    """A stage's line as the README's demo block quotes it: its words (times and measured
    waiting left out, decimals marked) and its decimals."""
    for varying in _VARYING:
        line = varying.sub(lambda m: m.group(1) if m.groups() else "measured", line)
    return _DECIMAL.sub("#", line), [float(d) for d in _DECIMAL.findall(line)]


def _readme_demo_lines() -> list[str]:
    """The stage lines README.md shows for ``make demo``."""
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
        return [line.rstrip("\n") for line in f if re.match(r"\[\d/8\] ", line)]


@pytest.mark.slow(minutes=3)
def test_demo_config_runs_every_stage_and_reruns_to_the_same_bytes(tmp_path, capsys):
    """The first run as ``make demo`` runs it, a process of its own, printing the lines
    README.md shows (but their times and measured waiting); the reruns in this one, their
    verify a quick one (the first decoded every image of the same bytes)."""
    out = tmp_path / "demo"
    stdout = vlmshard("run", "--config", _config(tmp_path, out)).stdout
    # One line per stage and a last one, nothing else: DeepSpeed's output goes to launcher.log.
    lines = stdout.splitlines()[:-1]
    readme = _readme_demo_lines()
    assert len(readme) == len(lines) == 8
    for quoted, printed in zip(readme, lines):
        words, decimals = _figures(printed.replace(str(out), "build/demo"))
        assert _figures(quoted) == (words, pytest.approx(decimals, rel=1e-3)), printed
    assert [line.split()[1] for line in lines] == ["demo-data", "demo-model", "preprocess",
                                                   "pack", "write", "verify", "train", "report"]
    assert [line.split()[0] for line in lines] == [f"[{i}/8]" for i in range(1, 9)]
    assert "OK:" in lines[5] and str(out / "report.html") in stdout.splitlines()[-1]

    report = read_json(out / "report.json")
    plan = read_json(out / "plan" / "plan.json")
    assert report["plans"][0]["metrics"]["cost_efficiency"] == plan["metrics"]["cost_efficiency"]
    assert report["train_log"]["steps"] == 3  # the warm-up step is left out
    # The report's line states the run's measured bubble and waiting next to the replay's.
    comparison = report["train_log"]
    assert (f"pipeline bubble measured {comparison['bubble']['measured']:.3f} (predicted "
            f"{comparison['bubble']['predicted']:.3f}), DP waiting measured "
            f"{comparison['dp_waiting']['measured']:.3f} (predicted "
            f"{comparison['dp_waiting']['predicted']:.3f})") in lines[7]
    described = read_json(out / "train" / "pipeline.json")
    assert [s["layers"] for s in described["stages"]] == [s["layers"] for s in
                                                           comparison["stage_bubble"]]
    with open(out / "train" / "train_log.jsonl") as f:
        log = [json.loads(line) for line in f]
    assert {r["stage"] for r in log[-1]["ranks"]} == {0, 1}
    # DeepSpeed's launcher's lines and its pipeline module's (in the ranks) went there
    launcher_log = (out / "train" / "launcher.log").read_text()
    assert "[launch.py:" in launcher_log and "Using topology: {ProcessCoord(pipe=0" in launcher_log
    assert (out / "report.html").stat().st_size > 10_000

    before = {name: tree_bytes(str(out / name)) for name in ("plan", "shards")}
    capsys.readouterr()
    rerun = _config(tmp_path, out, train=None, verify={"quick": True})
    vlmshard_here("run", "--config", rerun)
    stdout = capsys.readouterr().out
    assert [line.split()[1] for line in stdout.splitlines()[:-1]] == \
        ["demo-data", "demo-model", "preprocess", "pack", "write", "verify", "report"]
    assert {name: tree_bytes(str(out / name)) for name in ("plan", "shards")} == before

    # Deleted and made again from nothing, not skipped: the same bytes. Only run facts differ by
    # design: plan.run.json, and preprocess.json (timings, and the inputs' mtimes in its
    # fingerprint: the demo data is written anew), which tree_bytes leaves out.
    def plan_json() -> bytes:
        return (out / "plan" / "plan.json").read_bytes()

    first = {name: tree_bytes(str(out / name))
             for name in ("data", "model", "preprocess", "shards")}
    first_plan, first_info = (out / "plan" / "plan.parquet").read_bytes(), plan_json()
    assert first["shards"] and first["preprocess"] and first_plan
    shutil.rmtree(out)
    vlmshard_here("run", "--config", rerun)
    again = {name: tree_bytes(str(out / name)) for name in first}
    for name in first:  # manifest.json included
        assert sorted(again[name]) == sorted(first[name]), name
        assert [k for k in first[name] if again[name][k] != first[name][k]] == [], name
    assert (out / "plan" / "plan.parquet").read_bytes() == first_plan
    assert plan_json() == first_info


def test_run_config_errors_name_the_section(tmp_path):
    proc = vlmshard("run", "--config", _config(tmp_path, tmp_path / "x", pack={"dp": 2,
                                                                                "algoritm": 1}),
                    check=False)
    assert proc.returncode != 0
    assert "section 'pack': unknown key(s) algoritm" in proc.stderr
    proc = vlmshard("run", "--config", _config(tmp_path, tmp_path / "y", pack={}), check=False)
    assert proc.returncode != 0 and "missing required option(s) dp" in proc.stderr \
        and "section 'pack'" in proc.stderr
