"""Crash and resume, Ray Data on a real two-node cluster, and images served over HTTP."""

from __future__ import annotations

import glob
import json
import os

import pytest

from helpers import kill_9_when, serve_http, tree_bytes, vlmshard, vlmshard_here
from vlmshard.preprocess import PreprocessConfig, run_preprocess
from vlmshard.demo.data import generate


def test_kill_9_then_rerun_gives_identical_bytes(tmp_path):
    data = generate(str(tmp_path / "data"), seed=1, scale=5)
    args = [data.meta, "--part-size", "5", "--workers", "1", "--max-seq-len", "8192"]
    vlmshard_here("preprocess", *args, "--out", str(tmp_path / "reference"))

    out = tmp_path / "crashed"
    committed = lambda: glob.glob(str(out / "_work" / "parts" / "part-*.json"))  # noqa: E731
    kill_9_when("preprocess", *args, "--out", str(out), ready=lambda: len(committed()) >= 3)
    assert not (out / "preprocess.json").exists(), "job finished before it could be killed"
    n_before = len(committed())
    assert n_before >= 3

    rerun = vlmshard("preprocess", *args, "--out", str(out), "--json")
    result = json.loads(rerun.stdout)
    assert result["parts_resumed"] >= n_before
    assert tree_bytes(out) == tree_bytes(tmp_path / "reference")
    assert not (out / "_work").exists()


@pytest.mark.slow
def test_quiet_on_ray_prints_the_summary_line_alone(demo, tmp_path):
    """``vlmshard -q preprocess --engine ray``, on a Ray cluster it starts, prints the stage's
    one line and nothing else: Ray's loggers go through ours, its notices of its own defaults
    (token authentication, progress bars off) are left out, and its actors start without the
    restarts Ray warns about on stderr."""
    out = tmp_path / "pre"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH_")}  # Ray's own
    proc = vlmshard("-q", "preprocess", os.path.join(demo.root, "captions.jsonl"), "--engine",
                    "ray", "--workers", "2", "--part-size", "40", "--out", str(out), env=env)
    totals = json.loads((out / "preprocess.json").read_text())["totals"]
    assert proc.stderr == ""
    assert proc.stdout == (f"{totals['accepted']} accepted, {totals['rejected']} rejected of "
                           f"{totals['input_rows']} rows -> {out}\n")


@pytest.fixture(scope="module")
def http_root(demo):
    with serve_http(demo.root) as url:
        yield url


def test_annotations_and_images_over_http(demo, http_root, tmp_path):
    local = run_preprocess(PreprocessConfig(inputs=[os.path.join(demo.root, "captions.jsonl")],
                                            out=str(tmp_path / "local"), workers=1))
    remote = run_preprocess(PreprocessConfig(inputs=[f"{http_root}/captions.jsonl"],
                                             out=str(tmp_path / "remote"), workers=1))
    assert remote.accepted == local.accepted == 80
    import pyarrow.parquet as pq

    cols = ["row", "image_tiles", "seq_len", "image_sizes"]
    t_local = pq.read_table(tmp_path / "local" / "stats")
    t_remote = pq.read_table(tmp_path / "remote" / "stats")
    assert t_remote.select(cols).equals(t_local.select(cols))
    assert all(p[0].startswith(http_root) for p in t_remote["image_paths"].to_pylist())


@pytest.mark.slow
def test_ray_two_node_cluster_matches_local_bytes(demo, ray_cluster, tmp_path):
    common = dict(inputs=[demo.meta], max_seq_len=8192, part_size=32, keep_tokens=True)
    run_preprocess(PreprocessConfig(out=str(tmp_path / "local"), workers=1, **common))
    result = run_preprocess(PreprocessConfig(out=str(tmp_path / "ray"), engine="ray",
                                             ray_address=ray_cluster, **common))
    report = json.load(open(tmp_path / "ray" / "preprocess.json"))
    assert report["engine"]["name"] == "ray" and result.parts > 2
    assert tree_bytes(tmp_path / "ray") == tree_bytes(tmp_path / "local")
