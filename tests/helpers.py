"""Helpers for tests: run the console command, compare output trees byte for byte."""

from __future__ import annotations

import contextlib
import functools
import http.server
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Callable, Iterator

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def vlmshard(*args: str, check: bool = True, **kwargs) -> subprocess.CompletedProcess:
    """Run the real console command in a subprocess, as a user would."""
    proc = subprocess.run([sys.executable, "-m", "vlmshard.cli", *args], capture_output=True,
                          text=True, cwd=kwargs.pop("cwd", REPO), **kwargs)
    if check and proc.returncode != 0:
        raise AssertionError(f"vlmshard {' '.join(args)} exited {proc.returncode}:\n{proc.stderr}")
    return proc


def kill_9_when(*args: str, ready: Callable[[], bool], timeout: float = 120) -> None:
    """Start ``vlmshard ARGS`` and SIGKILL it as soon as ``ready()`` holds (a crash mid-job)."""
    proc = subprocess.Popen([sys.executable, "-m", "vlmshard.cli", *args], cwd=REPO,
                            stderr=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + timeout
    while not ready() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()


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


@contextlib.contextmanager
def serve_http(directory: str) -> Iterator[str]:
    """Serve ``directory`` over HTTP on loopback; yields the base URL."""
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(directory))
    handler.log_message = lambda *a, **k: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
