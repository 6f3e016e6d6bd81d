"""Shared helpers: atomic writes leave no torn files; CPU discovery respects the affinity mask;
local paths and fsspec URLs open, size and exist alike."""

import os

import pytest

from vlmshard.io import atomic_write, available_cpus, file_exists, file_size, is_url, open_file


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


def test_local_paths_and_fsspec_urls_read_alike(tmp_path):
    import fsspec

    data = bytes(range(256)) * 3
    local = tmp_path / "blob.bin"
    local.write_bytes(data)
    url = "memory://vlmshard-test-io/blob.bin"
    with fsspec.open(url, "wb") as f:
        f.write(data)
    for path in (str(local), url, local.as_uri()):
        assert is_url(path) == (path != str(local))
        with open_file(path) as f:
            assert f.read() == data
        assert file_size(path) == len(data)
        assert file_exists(path)
    assert not file_exists(str(tmp_path / "gone.bin"))
    assert not file_exists("memory://vlmshard-test-io/gone.bin")
    with pytest.raises(FileNotFoundError):
        open_file(str(tmp_path / "gone.bin"))
    with pytest.raises(FileNotFoundError):
        open_file("memory://vlmshard-test-io/gone.bin")
