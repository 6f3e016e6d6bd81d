"""Crash and resume, Ray Data on a real two-node cluster, and images served over HTTP."""

from __future__ import annotations

import functools
import glob
import http.server
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from helpers import REPO, tree_bytes, vlmshard
from preprocess import PreprocessConfig, run_preprocess
from preprocess.demo_data import generate


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_kill_9_then_rerun_gives_identical_bytes(tmp_path):
    data = generate(str(tmp_path / "data"), seed=1, scale=5)
    args = [data.meta, "--part-size", "5", "--workers", "1", "--max-seq-len", "8192"]
    vlmshard("preprocess", *args, "--out", str(tmp_path / "reference"))

    out = tmp_path / "crashed"
    proc = subprocess.Popen([sys.executable, "-m", "vlmshard.cli", "preprocess", *args,
                             "--out", str(out)], cwd=REPO, stderr=subprocess.DEVNULL)
    committed = lambda: glob.glob(str(out / "_work" / "parts" / "part-*.json"))  # noqa: E731
    deadline = time.monotonic() + 120
    while len(committed()) < 3 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (out / "preprocess.json").exists(), "job finished before it could be killed"
    n_before = len(committed())
    assert n_before >= 3

    rerun = vlmshard("preprocess", *args, "--out", str(out), "--json")
    result = json.loads(rerun.stdout)
    assert result["parts_resumed"] >= n_before
    assert tree_bytes(out) == tree_bytes(tmp_path / "reference")
    assert not (out / "_work").exists()


@pytest.fixture(scope="module")
def http_root(demo):
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=demo.root)
    handler.log_message = lambda *a, **k: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


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


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    """A real Ray cluster on loopback: a head node and a second worker node, one CPU each.

    Token authentication with a token of its own: a stale ``~/.ray/auth_token`` (left by any
    earlier ``ray.init``) otherwise makes ``ray start --address`` fail with InvalidAuthToken.
    """
    token = tmp_path_factory.mktemp("ray") / "auth_token"
    token.write_text(secrets.token_hex(32))
    saved = {k: os.environ.get(k) for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH")}
    os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token))
    ray_bin = os.path.join(os.path.dirname(sys.executable), "ray")
    port = _free_port()
    address = f"127.0.0.1:{port}"
    common = ["--num-cpus=1", "--node-ip-address=127.0.0.1", "--disable-usage-stats",
              "--object-store-memory=200000000"]
    try:
        subprocess.run([ray_bin, "start", "--head", f"--port={port}", "--include-dashboard=false",
                        *common], check=True, capture_output=True, timeout=180)
        subprocess.run([ray_bin, "start", f"--address={address}", *common], check=True,
                       capture_output=True, timeout=180)
        yield address
    except subprocess.CalledProcessError as e:
        raise RuntimeError(f"{' '.join(e.cmd)} failed:\n{e.stderr.decode()[-2000:]}") from None
    finally:
        subprocess.run([ray_bin, "stop", "--force"], capture_output=True, timeout=180)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.mark.slow
def test_ray_two_node_cluster_matches_local_bytes(demo, ray_cluster, tmp_path):
    common = dict(inputs=[demo.meta], max_seq_len=8192, part_size=32, keep_tokens=True)
    run_preprocess(PreprocessConfig(out=str(tmp_path / "local"), workers=1, **common))
    result = run_preprocess(PreprocessConfig(out=str(tmp_path / "ray"), engine="ray",
                                             ray_address=ray_cluster, **common))
    report = json.load(open(tmp_path / "ray" / "preprocess.json"))
    assert report["engine"]["name"] == "ray" and result.parts > 2
    assert tree_bytes(tmp_path / "ray") == tree_bytes(tmp_path / "local")
