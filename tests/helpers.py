"""Helpers for tests: run the console command, compare output trees byte for byte."""

from __future__ import annotations

import ast
import contextlib
import functools
import gc
import http.server
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Iterator

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_python(path: str) -> ast.Module:
    """A source file's syntax tree, built with the garbage collector off. CPython 3.11.7 keeps
    the AST constructor's recursion count per interpreter, not per thread: when a collection
    during the build runs finalizers, another thread may build a tree meanwhile (a Ray Data
    usage thread left behind formats tracebacks, and 3.11 finds a traceback's carets by parsing
    the line), and the build fails with "SystemError: AST constructor recursion depth mismatch"
    (python/cpython#106905, fixed in 3.11.8). Retrying was not enough: CI failed three builds in a
    row. With no collection, no Python code runs during the build and no other thread can."""
    with open(path, encoding="utf-8") as f:
        source = f.read()
    collecting = gc.isenabled()
    gc.disable()
    try:
        return ast.parse(source, path)
    finally:
        if collecting:
            gc.enable()


def vlmshard(*args: str, check: bool = True, **kwargs) -> subprocess.CompletedProcess:
    """Run the real console command in a subprocess, as a user would."""
    proc = subprocess.run([sys.executable, "-m", "vlmshard.cli", *args], capture_output=True,
                          text=True, cwd=kwargs.pop("cwd", REPO), **kwargs)
    if check and proc.returncode != 0:
        raise AssertionError(f"vlmshard {' '.join(args)} exited {proc.returncode}:\n{proc.stderr}")
    return proc


def vlmshard_here(*args: str) -> None:
    """Run ``vlmshard ARGS`` in this process: its parsing, checks and stage, with DeepSpeed's
    launcher and the ranks started as processes of their own. For tests of what a command does,
    not of its process (exit status, output: :func:`vlmshard`); it spares each launch the ~9 s of
    CPU a fresh interpreter spends importing torch and transformers before the ranks start,
    which this process has imported already."""
    from vlmshard.cli import main

    status = main(list(args))
    if status:
        raise AssertionError(f"vlmshard {' '.join(args)} exited {status} (its error is above)")


def kill_9_when(*args: str, ready: Callable[[], bool], timeout: float = 120,
                session: bool = False) -> None:
    """Start ``vlmshard ARGS`` and SIGKILL it as soon as ``ready()`` holds (a crash mid-job).
    ``session``: it runs in a session of its own, and the whole session is killed, launcher
    and every process it started (a node crash, for multi-process jobs such as train)."""
    proc = subprocess.Popen([sys.executable, "-m", "vlmshard.cli", *args], cwd=REPO,
                            stderr=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            start_new_session=session)
    deadline = time.monotonic() + timeout
    while not ready() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    with contextlib.suppress(ProcessLookupError):  # it may have ended (and been reaped)
        (os.killpg if session else os.kill)(proc.pid, signal.SIGKILL)
    proc.wait()


@contextlib.contextmanager
def shared_folder(tmp_path_factory, name: str) -> Iterator[Path]:
    """The folder ``name`` that every pytest worker of this session shares, held under a file
    lock while the block runs: what the block makes there the first worker makes, and the others
    find made (pytest-xdist's recipe for a fixture run once). Without xdist, this process's."""
    from filelock import FileLock

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the session's folder, above each worker's
    with FileLock(str(root / f"{name}.lock")):
        yield root / name


def tree_bytes(root: str) -> dict[str, bytes]:
    """Every output file's bytes except preprocess.json (which holds timings)."""
    out = {}
    for dirpath, _, files in os.walk(root):
        for name in files:
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, root)
            if rel != "preprocess.json":
                with open(path, "rb") as f:
                    out[rel] = f.read()
    return out


class FaultyFiles(http.server.SimpleHTTPRequestHandler):
    """Serves files with byte ranges (as object stores do) and injects faults: ``faults`` maps a
    URL path to the faults its next requests meet, one per request, in order: ``503``, ``cut``
    (the body stops halfway under a full Content-Length), ``reset`` (the connection closes with
    no answer). A fault ending in ``*`` never runs out. Other requests meet one of those three at
    random with probability ``drop_rate``, and wait ``stall_s`` first with ``stall_rate``.
    ``requests`` counts requests per path, ``injected`` the faults met per kind."""

    faults: dict[str, list[str]] = {}
    requests: dict[str, int] = {}
    injected: dict[str, int] = {}
    drop_rate = stall_rate = 0.0
    stall_s = 1.0
    rng = random.Random(0)

    def log_message(self, *args) -> None:
        pass

    def handle(self) -> None:
        with contextlib.suppress(ConnectionError):  # a client that gave up on a stall
            super().handle()

    def _fault(self) -> str | None:
        path = self.path.split("?")[0]
        self.requests[path] = self.requests.get(path, 0) + 1
        queue = self.faults.get(path)
        if queue:
            fault = queue[0].rstrip("*") if queue[0].endswith("*") else queue.pop(0)
        elif self.rng.random() < self.drop_rate:
            fault = self.rng.choice(["503", "reset", "cut"])
        else:
            fault = None
        if self.rng.random() < self.stall_rate:
            self.injected["stall"] = self.injected.get("stall", 0) + 1
            time.sleep(self.stall_s)
        if fault:
            self.injected[fault] = self.injected.get(fault, 0) + 1
        return fault

    def do_HEAD(self) -> None:
        self.do_GET(body=False)

    def do_GET(self, body: bool = True) -> None:
        fault = self._fault()
        if fault == "503":
            self.send_error(503)
            return
        if fault == "reset":
            self.close_connection = True
            return
        path = self.translate_path(self.path)
        if not os.path.isfile(path):
            self.send_error(404)
            return
        with open(path, "rb") as f:
            data = f.read()
        start, end, status = 0, len(data), 200
        if ranged := re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range", "")):
            start = int(ranged[1])
            end = min(end, int(ranged[2]) + 1) if ranged[2] else end
            status = 206
            if start >= len(data):
                self.send_error(416)
                return
        self.send_response(status)
        self.send_header("Content-Length", str(end - start))
        self.send_header("Accept-Ranges", "bytes")
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(data)}")
        self.end_headers()
        if body:
            part = data[start:end]
            self.wfile.write(part[:len(part) // 2] if fault == "cut" else part)
            if fault == "cut":
                self.close_connection = True


@contextlib.contextmanager
def serve_http(directory: str, faults: dict[str, list[str]] | None = None,
               requests: dict[str, int] | None = None, **random_faults) -> Iterator[str]:
    """Serve ``directory`` over HTTP on loopback; ``faults``, ``requests`` and
    ``random_faults`` (``drop_rate``, ``stall_rate``, ``stall_s``, ``injected``, ``rng``) as
    ``FaultyFiles`` describes. Yields the base URL."""
    handler = type("Handler", (FaultyFiles,), {
        "faults": faults or {}, "requests": {} if requests is None else requests,
        "injected": {}, "rng": random.Random(0), **random_faults})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0),
                                             functools.partial(handler, directory=str(directory)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
