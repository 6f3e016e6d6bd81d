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


def test_atomic_write_syncs_the_data_before_the_rename_and_the_folder_after(tmp_path,
                                                                          monkeypatch):
    """After a power loss a committed file must not exist empty: its bytes reach the device
    before its name does (fsync, rename), and the name before the job counts it done."""
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src, dst):
        events.append(("rename", str(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    target = tmp_path / "part.json"
    atomic_write(target, lambda tmp: open(tmp, "w").write("{}"))
    assert [e[0] for e in events] == ["fsync", "rename", "fsync"]
    assert os.path.basename(events[0][1]).startswith(".tmp-part.json-")
    assert events[1][1] == str(target) and events[2][1] == str(tmp_path)
