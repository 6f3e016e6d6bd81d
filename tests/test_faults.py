"""Faults injected for real: a loopback HTTP server that answers 503, cuts bodies halfway or
drops connections (``helpers.FaultyFiles``). Each run must end either as a clean run does or
with one clear line naming what failed, and nothing counted done that is not."""

from __future__ import annotations

import contextlib
import glob
import itertools
import json
import os
import re
import shutil
import subprocess
from typing import Iterator

import pyarrow.parquet as pq
import pytest
import torch

from vlmshard.preprocess import PreprocessConfig, run_preprocess
from vlmshard.shards.layout import read_manifest
from vlmshard.shards.loader import ShardDataset
from vlmshard.shards.reader import ShardError

from helpers import kill_9_when, serve_http, tree_bytes, vlmshard, vlmshard_here


@pytest.fixture(autouse=True)
def quick_retries(monkeypatch):
    """Retries as in production, but waiting milliseconds."""
    monkeypatch.setenv("VLMSHARD_REMOTE_WAIT_S", "0.01")


def _noisy_reasons(noisy) -> dict[int, str]:
    """Row -> the reason its ``id`` names (``accepted...`` rows are kept). Read as bytes: some
    rows are deliberately not JSON or not UTF-8."""
    with open(noisy, "rb") as f:
        return {row: re.search(rb'"id": "([^"]+)"', line)[1].decode() for row, line in enumerate(f)}


def test_remote_images_get_the_local_reasons_through_transient_faults(demo, demo_out, tmp_path):
    served = tmp_path / "served"
    served.mkdir()
    shutil.copytree(os.path.join(demo.root, "images"), served / "images")
    shutil.copy(os.path.join(demo.root, "noisy.jsonl"), served / "noisy.jsonl")
    expected = _noisy_reasons(served / "noisy.jsonl")
    with open(served / "noisy.jsonl", "rb") as f:
        good = next(m[1].decode() for line in f if b'"id": "accepted' in line
                    and (m := re.search(rb'"image": "([^"]+)"', line)))
    flaky_row = max(expected) + 1
    with open(served / "noisy.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps({"id": "unreachable_image", "image": "images/flaky.jpg",
                            "conversations": [{"from": "human", "value": "<image>\nWhat?"},
                                              {"from": "gpt", "value": "A photo."}]}) + "\n")
    shutil.copy(served / good, served / "images" / "flaky.jpg")  # fine, but never served
    expected[flaky_row] = "unreachable_image"
    faults = {"/noisy.jsonl": ["503", "reset"], f"/{good}": ["503", "cut", "reset"],
              "/images/flaky.jpg": ["503*"]}
    requests: dict[str, int] = {}
    with serve_http(served, faults, requests) as url:
        result = run_preprocess(PreprocessConfig(
            inputs=[f"{url}/noisy.jsonl"], image_root=url, out=str(tmp_path / "out"),
            max_seq_len=8192, workers=1))
    rejects = pq.read_table(tmp_path / "out" / "rejects.parquet").to_pylist()
    got = {r["row"]: r["reason"] for r in rejects}
    assert got == {row: reason for row, reason in expected.items()
                   if not reason.startswith("accepted")}
    flaky = next(r for r in rejects if r["row"] == flaky_row)
    assert f"{url}/images/flaky.jpg" in flaky["message"] and "503" in flaky["message"]
    assert requests["/images/flaky.jpg"] == 6  # every attempt made
    assert requests[f"/{good}"] > 3  # the faults were met, and retried past
    # The accepted rows are the local run's, counted the same.
    local = pq.read_table(demo_out / "stats").to_pylist()
    remote = pq.read_table(tmp_path / "out" / "stats").to_pylist()
    key = ("row", "seq_len", "loss_tokens", "image_tiles")
    assert [tuple(r[k] for k in key) for r in remote] == \
        [tuple(r[k] for k in key) for r in local if r["source"] == "noisy"]
    assert result.input_rows == len(expected)


def test_a_remote_annotation_file_that_keeps_failing_is_one_line(demo, tmp_path):
    served = tmp_path / "served"
    served.mkdir()
    shutil.copy(os.path.join(demo.root, "chat.jsonl"), served / "chat.jsonl")
    with serve_http(served, {"/chat.jsonl": ["503*"]}) as url:
        proc = vlmshard("preprocess", f"{url}/chat.jsonl", "--out", str(tmp_path / "out"),
                        check=False)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert "Traceback" not in proc.stderr
    assert f"{url}/chat.jsonl" in lines[-1] and "503" in lines[-1], proc.stderr


@pytest.fixture(scope="module")
def shards(demo_out, tmp_path_factory):
    from vlmshard.packing.config import PackConfig
    from vlmshard.packing.plan import run_pack
    from vlmshard.shards.config import WriteConfig
    from vlmshard.shards.writer import run_write

    work = tmp_path_factory.mktemp("fault-shards")
    run_pack(PackConfig(stats=str(demo_out), dp=1, micro_batches=2, out=str(work / "plan")))
    run_write(WriteConfig(plan=str(work / "plan"), stats=str(demo_out), out=str(work / "shards"),
                          shard_bytes="4MB", workers=1))
    return str(work / "shards")


def _summary(records) -> list[tuple]:
    return [(r.step, r.micro, tuple(s["sample_id"] for s in r.samples), r.input_ids.tobytes(),
             tuple(r.images)) for r in records]


def test_shards_over_http_read_the_same_records_through_faults(shards):
    manifest = read_manifest(shards)
    assert len(manifest.shards) > 1
    reference = _summary(ShardDataset(shards).records())
    tars = [f"/{e.path}" for e in manifest.shards]
    for mode in ("stream", "seek"):
        requests: dict[str, int] = {}
        faults = {t: ["503", "cut", "reset", "cut"] for t in tars}
        with serve_http(shards, faults, requests) as url:
            ds = ShardDataset(url)
            if mode == "stream":
                got = _summary(ds.records())
            else:
                parts = [_summary(ds.worker_records(w, 2)) for w in range(2)]
                got = [parts[i % 2][i // 2] for i in range(len(reference))]
        assert got == reference, mode
        assert all(not faults[t] for t in tars), mode  # every fault was met and got past
    with serve_http(shards, {tars[-1]: ["503*"]}) as url:
        with pytest.raises(ShardError, match=re.escape(f"{url}{tars[-1]}") + ".*still failing "
                                             "after 6 attempts.*503"):
            list(ShardDataset(url).records())


def test_a_part_torn_behind_the_jobs_back_is_done_again(demo, tmp_path):
    """Killed mid-job, then one committed part's stats file truncated and another's rejects file
    deleted: the rerun processes exactly those two again and ends byte-identical to a clean
    run."""
    args = [demo.meta, "--part-size", "5", "--workers", "1", "--max-seq-len", "8192"]
    out = tmp_path / "torn"
    parts = out / "_work" / "parts"
    committed = lambda: sorted(glob.glob(str(parts / "part-*.json")))  # noqa: E731
    kill_9_when("preprocess", *args, "--out", str(out), ready=lambda: len(committed()) >= 4)
    assert not (out / "preprocess.json").exists(), "job finished before it could be killed"
    done = committed()
    torn, gone = done[0].replace(".json", ".stats.parquet"), done[1].replace(".json",
                                                                              ".rejects.parquet")
    with open(torn, "r+b") as f:
        f.truncate(os.path.getsize(torn) // 2)
    os.unlink(gone)
    rerun = json.loads(vlmshard("preprocess", *args, "--out", str(out), "--json").stdout)
    assert rerun["parts_resumed"] == len(done) - 2
    vlmshard_here("preprocess", *args, "--out", str(tmp_path / "clean"))
    assert tree_bytes(out) == tree_bytes(tmp_path / "clean")


@contextlib.contextmanager
def small_disk(path, size: str) -> Iterator[str]:
    """A tmpfs of ``size`` mounted at ``path`` (root only; skipped where mounting is denied);
    yields a command that resizes it."""
    os.makedirs(path, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                             capture_output=True, text=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.strip()}")
    try:
        yield lambda new: subprocess.run(["mount", "-o", f"remount,size={new}", str(path)],
                                         check=True)
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


@pytest.mark.slow
def test_a_full_disk_is_one_line_and_a_rerun_with_space_completes_identically(demo, tmp_path):
    pre_args = [demo.meta, "--part-size", "16", "--workers", "1", "--max-seq-len", "8192",
                "--keep-tokens"]
    vlmshard_here("preprocess", *pre_args, "--out", str(tmp_path / "pre"))
    vlmshard_here("pack", "--stats", str(tmp_path / "pre"), "--dp", "1", "--out",
                  str(tmp_path / "plan"))
    write_args = ["--plan", str(tmp_path / "plan"), "--stats", str(tmp_path / "pre"),
                  "--shard-bytes", "8MB", "--workers", "1"]
    vlmshard_here("write", *write_args, "--out", str(tmp_path / "shards"))
    disk = tmp_path / "disk"
    for stage, args, clean, size in (("preprocess", pre_args, "pre", "96k"),
                                     ("write", write_args, "shards", "48m")):
        with small_disk(disk, size) as resize:
            out = disk / stage
            proc = vlmshard(stage, *args, "--out", str(out), check=False)
            assert proc.returncode != 0, f"{stage} fit into {size}"
            last = proc.stderr.strip().splitlines()[-1]
            assert "Traceback" not in proc.stderr and "No space left on device" in last, \
                proc.stderr
            assert not (out / ("preprocess.json" if stage == "preprocess" else "manifest.json")
                        ).exists()
            resize("512m")
            vlmshard(stage, *args, "--out", str(out))
            assert tree_bytes(out) == tree_bytes(tmp_path / clean), stage


FLAKY = {"drop_rate": 0.2, "stall_rate": 0.05, "stall_s": 1.0}  # 20% dropped, 5% stalled


@pytest.fixture
def flaky_env(monkeypatch):
    """Stalls count as failures after 0.3 s; 10 attempts, so a read fails only if ten in a row
    do (p < 1e-6 at these rates)."""
    monkeypatch.setenv("VLMSHARD_REMOTE_STALL_S", "0.3")
    monkeypatch.setenv("VLMSHARD_REMOTE_ATTEMPTS", "10")


def _comparable(out) -> tuple[list, list]:
    """Stats rows less their image and video paths (local paths vs URLs), and the rejects' row
    and reason."""
    stats = pq.read_table(os.path.join(out, "stats")).drop(["image_paths"]).to_pylist()
    for row in stats:
        row["videos"] = [{k: v for k, v in video.items() if k != "paths"}
                         for video in row["videos"]]
    rejects = [(r["source"], r["row"], r["reason"])
               for r in pq.read_table(os.path.join(out, "rejects.parquet")).to_pylist()]
    return stats, rejects


@pytest.mark.slow
def test_preprocess_over_a_flaky_server_equals_the_local_run(demo, tmp_path, flaky_env):
    args = dict(max_seq_len=8192, part_size=64, workers=1)
    run_preprocess(PreprocessConfig(inputs=[demo.meta], out=str(tmp_path / "local"), **args))
    with serve_http(demo.root, **FLAKY, injected=(injected := {})) as url:
        run_preprocess(PreprocessConfig(inputs=[f"{url}/meta.json"], out=str(tmp_path / "http"),
                                        **args))
    assert _comparable(tmp_path / "http") == _comparable(tmp_path / "local")
    assert sum(injected.values()) > 20 and injected.get("stall", 0) > 0, injected


@pytest.mark.slow
def test_the_loader_over_a_flaky_server_equals_the_local_folder(shards, flaky_env):
    from vlmshard.shards.loader import make_loader

    reference = _summary(ShardDataset(shards).records())
    local = list(itertools.islice(make_loader(shards, num_workers=2), 3))
    with serve_http(shards, **FLAKY, injected=(injected := {})) as url:
        assert _summary(ShardDataset(url).records()) == reference
        remote = list(itertools.islice(make_loader(url, num_workers=2), 3))
    for a, b in zip(local, remote, strict=True):
        assert all(torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] == b[k] for k in a)
    assert sum(injected.values()) > 5, injected
