"""Shared fixtures: the demo dataset (generated from scikit-image's photos, no ../shared needed)."""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
from typing import Iterator

# pytest-xdist's workers share the CPUs: each worker, and every process it starts, takes its share
# of OpenMP threads, set before torch or numpy is imported: two workers of two threads each on 2
# CPUs spin against each other at OpenMP's barriers (BENCHMARKS.md).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // _WORKERS)))

import pytest  # noqa: E402
from helpers import shared_folder  # noqa: E402

from vlmshard.preprocess import PreprocessConfig, run_preprocess  # noqa: E402
from vlmshard.demo.data import DemoDataset, generate  # noqa: E402


@pytest.fixture(scope="session")
def demo(tmp_path_factory) -> DemoDataset:
    """The demo dataset, generated once for all workers (``generate`` finds it built after)."""
    with shared_folder(tmp_path_factory, "demo") as folder:
        return generate(str(folder), seed=0)


@pytest.fixture(scope="session")
def demo_out(demo, tmp_path_factory):
    """The demo data preprocessed once (tokens kept), as later stages read it: by the first
    worker that needs it (a test may rerun the finished job meanwhile, which holds its lock)."""
    with shared_folder(tmp_path_factory, "pre") as out:
        if not (out / "preprocess.json").exists():  # the job's record, written as it ends
            run_preprocess(PreprocessConfig(inputs=[demo.meta], out=str(out), keep_tokens=True,
                                            workers=1, max_seq_len=8192, part_size=64))
    return out


def _stop_ray(temp_dir: str) -> None:
    """Stop the Ray processes whose command line names ``temp_dir`` (GCS, raylets, monitors),
    and their children (agents and workers, renamed ``ray::...``), leaving any other Ray."""
    import psutil

    named = [p for p in psutil.process_iter(["cmdline"])
             if any(temp_dir in part for part in p.info["cmdline"] or ())]
    procs = {p.pid: p for p in named}
    for p in named:
        try:
            procs.update({c.pid: c for c in p.children(recursive=True)})
        except psutil.NoSuchProcess:
            pass
    for p in procs.values():
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    # a few seconds: some of Ray's processes never exit on SIGTERM (a teardown waited out 15 s)
    _, alive = psutil.wait_procs(list(procs.values()), timeout=3)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def ray_auth_token(tmp_path_factory) -> Iterator[str]:
    """Token authentication for this process's Ray clusters, with a token of its own: a stale
    ``~/.ray/auth_token`` (left by any earlier ``ray.init``) otherwise makes ``ray start
    --address`` fail with InvalidAuthToken. One token for the whole session: a driver keeps the
    first token it read, and a later cluster with another refuses it."""
    token = tmp_path_factory.mktemp("ray") / "auth_token"
    token.write_text(secrets.token_hex(32))
    saved = {k: os.environ.get(k) for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH")}
    os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token))
    yield str(token)
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(scope="module")
def ray_cluster(ray_auth_token) -> Iterator[str]:
    """A real Ray cluster on loopback: a head node and a second worker node, one CPU each. One
    a module, stopped after it: idle, the cluster's daemons burn CPU that a cluster kept for the
    whole test session would take from the rest of the suite, for more than a start costs.

    Its own temp dir, and stopped by it: ``ray stop`` would stop every Ray on the machine, the
    other test worker's cluster among them.

    Its workers at the suite's niceness: Ray starts them at 15 (the raylet's ``worker_niceness``),
    so beside the other test workers' DeepSpeed ranks they got a sliver of the CPUs and their
    tests crawled (BENCHMARKS.md).
    """
    ray_bin = os.path.join(os.path.dirname(sys.executable), "ray")
    port = _free_port()
    address = f"127.0.0.1:{port}"
    # short: the session's Unix sockets live under it (paths are limited to 107 bytes)
    temp_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    common = ["--num-cpus=1", "--node-ip-address=127.0.0.1", "--disable-usage-stats",
              "--object-store-memory=200000000", f"--temp-dir={temp_dir}"]
    try:
        env = {**os.environ, "RAY_worker_niceness": "0"}
        subprocess.run([ray_bin, "start", "--head", f"--port={port}", "--include-dashboard=false",
                        *common], check=True, capture_output=True, timeout=180, env=env)
        subprocess.run([ray_bin, "start", f"--address={address}", *common], check=True,
                       capture_output=True, timeout=180, env=env)
        yield address
    except subprocess.CalledProcessError as e:
        raise RuntimeError(f"{' '.join(e.cmd)} failed:\n{e.stderr.decode()[-2000:]}") from None
    finally:
        _stop_ray(temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)


def expected_minutes(item) -> float:
    """What the suite is ordered by: a slow test's ``minutes`` (``@pytest.mark.slow(minutes=N)``,
    about its time in ``make test`` on 2 CPUs), 1 for other slow tests, 0 for the rest."""
    marker = item.get_closest_marker("slow")
    return 0 if marker is None else marker.kwargs.get("minutes", 1)


def pytest_collection_modifyitems(items: list) -> None:
    """The longest tests first, the rest in their order: ``make test``'s workers take the next
    test as each finishes (``--dist load --maxschedchunk 1``), so all start on the long
    launches and end on short tests, not one worker alone in a long launch while the others
    idle (the tail of a run in collection order was 16 of its 23 minutes)."""
    items.sort(key=lambda item: -expected_minutes(item))
