"""``benchmarks/gpu_session.sh``, the one script a lent GPU machine runs, dry-run on CPU
(``--smoke``) before a lease: every step at the smallest sizes, the same phases as on the
device, the same files; and its device-time estimate inside the 8 minutes a lease gives it."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import tarfile

import pytest
from helpers import REPO

SCRIPT = os.path.join(REPO, "benchmarks", "gpu_session.sh")
# the default's phases: vlmshard's full fine-tune (traced) and the recipe users run (the vision
# tower frozen), each eager with the packed Hugging Face peer and with the blocks compiled
RUNS = ("balanced", "balanced_compiled", "balanced_frozen_vit", "balanced_compiled_frozen_vit")
PEERS = {"hf_packed": "balanced", "hf_packed_frozen_vit": "balanced_frozen_vit"}
LEASE_S = 8 * 60


def _default(name: str) -> int:
    """A ``NAME=${NAME:-default}`` setting of the script."""
    with open(SCRIPT, encoding="utf-8") as f:
        return int(re.search(rf"^{name}=\$\{{{name}:-(\d+)\}}$", f.read(), re.M).group(1))


def _estimate() -> dict[str, int]:
    """The header's device time by phase, in seconds (its ``#   name  seconds  why`` rows)."""
    with open(SCRIPT, encoding="utf-8") as f:
        return {m[1]: int(m[2]) for m in re.finditer(r"^#   (\w+) +(\d+)(?:  |$)", f.read(), re.M)}


def test_its_estimate_fits_a_lease():
    """The phases' estimates add up to the total the header states, inside the deadline the
    bench is held to, itself inside 8 device-minutes; the CUDA tests' timeout (TESTS_S) hides
    behind the preparation they run beside; every phase the default runs is estimated."""
    rows = _estimate()
    total = rows.pop("total")
    assert sum(rows.values()) == total <= _default("DEADLINE_S") <= LEASE_S
    assert _default("TESTS_S") < rows["prepare"]
    assert {"install", "prepare", *RUNS, *PEERS} <= set(rows)


@pytest.mark.slow(minutes=4)
@pytest.mark.timeout(900)
def test_smoke_runs_every_phase_on_cpu(tmp_path):
    """``gpu_session.sh --smoke`` with this environment's python: exit 0; gpu.json holds each
    phase of the default with finite positive tokens/s and a loss a step; each peer's first
    step loses what vlmshard's did on the same recipe (the smoke test of gpu_bench's bound,
    1e-4), and its last step too, where the frozen vision tower shows (the full fine-tune's
    last loss differs); the compiled blocks lose what the eager ones do on each recipe, whose
    peer trains once; runs.tgz holds each
    run's train log and the traced step's summary."""
    out, build = tmp_path / "out", tmp_path / "build"
    env = {**os.environ, "OUT": str(out), "BUILD": str(build),
           "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]}
    proc = subprocess.run(["bash", SCRIPT, "--smoke"], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=840)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert re.search(r"a device run carries \d+ MiB of 64", proc.stdout)
    assert re.search(r"^\d+/\d+ tests collected", (out / "cuda-tests.log").read_text(), re.M)
    result = json.loads((out / "gpu.json").read_text())
    phases = {**{name: result[name] for name in RUNS}, **result["baseline"]}
    assert set(result["baseline"]) == set(PEERS)
    for name, run in phases.items():
        assert math.isfinite(run["tokens_per_s"]) and run["tokens_per_s"] > 0, name
        assert len(run["loss"]) == 3 and all(map(math.isfinite, run["loss"])), name
    for peer, run in PEERS.items():
        assert phases[peer]["loss"][0] == pytest.approx(phases[run]["loss"][0], abs=1e-4)
        assert phases[peer]["loss"][-1] == pytest.approx(phases[run]["loss"][-1], abs=1e-5)
    assert abs(phases["balanced"]["loss"][-1] - phases["balanced_frozen_vit"]["loss"][-1]) > 1e-4
    for eager in ("balanced", "balanced_frozen_vit"):
        compiled = phases[eager.replace("balanced", "balanced_compiled")]
        assert compiled["loss"] == pytest.approx(phases[eager]["loss"], abs=1e-4), eager
        assert compiled["compilations"][-1] > 0
    assert result["balanced"]["trace"]["host_sites"]["sampled_s"] > 0
    with tarfile.open(out / "runs.tgz") as tar:
        names = set(tar.getnames())
    assert {f"gpu_bench/run-{run.replace('_', '-', 1)}/train_log.jsonl" for run in RUNS} <= names
    assert "gpu-trace/balanced/trace-rank0-step1-summary.json" in names
    assert (out / "pipeline-balanced.json").exists()
