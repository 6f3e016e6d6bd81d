"""One job at a time per output folder: the lock, and the refusal naming its holder."""

from __future__ import annotations

import multiprocessing
import os
import re
import socket
import subprocess
import sys

import pytest

from vlmshard.errors import JobError
from vlmshard.io import read_json, write_json_atomic
from vlmshard.jobs import OWNER, locked_output

STARTS = 24


def _contend(out: str, barrier, results, release) -> None:
    """Take the lock the instant every contender is ready; hold it until ``release``."""
    barrier.wait()
    try:
        with locked_output(out, JobError):
            results.put(("held", os.getpid()))
            release.wait(120)
    except JobError as e:
        results.put(("refused", str(e)))


def test_simultaneous_starts_one_holds_and_every_other_names_it(tmp_path):
    """The holder may take the lock an instant before the others try it, and before it has
    written its owner record: every refusal still names its pid, host and start time."""
    out = str(tmp_path / "out")
    ctx = multiprocessing.get_context("spawn")
    barrier, results, release = ctx.Barrier(STARTS), ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=_contend, args=(out, barrier, results, release))
             for _ in range(STARTS)]
    for p in procs:
        p.start()
    try:
        outcomes = [results.get(timeout=120) for _ in range(STARTS)]
    finally:
        release.set()
        for p in procs:
            p.join(timeout=60)
    held = [pid for kind, pid in outcomes if kind == "held"]
    assert len(held) == 1, outcomes
    holder = (rf"{re.escape(out)} is in use by another vlmshard job \(pid {held[0]} on "
              rf"{re.escape(socket.gethostname())}, started \d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d\); "
              r"wait for it to end or pass another --out")
    refusals = [message for kind, message in outcomes if kind == "refused"]
    assert len(refusals) == STARTS - 1
    for message in refusals:
        assert re.fullmatch(holder, message), message
    assert all(p.exitcode == 0 for p in procs)
    assert not os.path.exists(os.path.join(out, OWNER))  # the holder removed it on release


def test_a_record_left_by_a_killed_holder_neither_blocks_nor_names_it(tmp_path):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a pid no process has now
    out = tmp_path / "out"
    write_json_atomic(out / OWNER, {"pid": gone.pid, "host": socket.gethostname(),
                                    "started": "2000-01-01 00:00:00"})
    with locked_output(str(out), JobError):
        assert read_json(out / OWNER)["pid"] == os.getpid()
        with pytest.raises(JobError, match=rf"\(pid {os.getpid()} on "):
            with locked_output(str(out), JobError):
                pass
    assert not (out / OWNER).exists()
    with locked_output(str(out), JobError):  # free again
        pass


def test_a_rerun_naming_the_inputs_another_way_is_the_same_job(tmp_path, monkeypatch):
    """Relative, ``./``, absolute and through a symlinked folder: one file, one finished job;
    a changed file is refused naming what differs."""
    from vlmshard.preprocess import ConfigError, PreprocessConfig, run_preprocess

    data = tmp_path / "data"
    data.mkdir()
    rows = data / "chat.jsonl"
    rows.write_text('{"messages": [{"role": "user", "content": "Hi"}, '
                    '{"role": "assistant", "content": "Hello."}]}\n')
    (tmp_path / "link").symlink_to(data, target_is_directory=True)
    monkeypatch.chdir(tmp_path)
    out = str(tmp_path / "out")
    names = ["data/chat.jsonl", "./data/chat.jsonl", str(rows), str(tmp_path / "link/chat.jsonl")]
    results = [run_preprocess(PreprocessConfig(inputs=[name], out=out, workers=1))
               for name in names]
    assert [r.already_complete for r in results] == [False, True, True, True]
    with open(rows, "a") as f:
        f.write('{"messages": [{"role": "user", "content": "Bye"}, '
                '{"role": "assistant", "content": "Bye."}]}\n')
    with pytest.raises(ConfigError, match=r"finished job with other inputs or config "
                                          r"\(differing: sources\[0\]\.file\.bytes, "
                                          r"sources\[0\]\.file\.mtime_ns\)"):
        run_preprocess(PreprocessConfig(inputs=[names[0]], out=out, workers=1))
