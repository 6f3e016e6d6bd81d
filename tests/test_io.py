"""Shared helpers: atomic writes leave no torn files; CPU discovery respects the affinity mask."""

import os

import pytest

from vlmshard.io import atomic_write, available_cpus


def test_available_cpus_respects_affinity():
    assert 1 <= available_cpus() <= len(os.sched_getaffinity(0))


def test_atomic_write_keeps_old_file_on_failure(tmp_path):
    target = tmp_path / "f.txt"
    target.write_text("old")

    def failing(tmp):
        with open(tmp, "w") as f:
            f.write("half")
        raise RuntimeError("crash mid-write")

    with pytest.raises(RuntimeError):
        atomic_write(target, failing)
    assert target.read_text() == "old"
    assert os.listdir(tmp_path) == ["f.txt"]
