"""Shards: the writer, verify and the loader, on the demo data run through the real stages."""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tarfile
import time
import zlib

import msgpack
import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

import image_references as ref
from helpers import REPO, kill_9_when, serve_http, tree_bytes, vlmshard
from vlmshard.errors import ConfigError
from vlmshard.packing.config import PackConfig
from vlmshard.packing.plan import run_pack
from vlmshard.preprocess import PreprocessConfig, run_preprocess
from vlmshard.shards.layout import read_manifest, record_key
from vlmshard.shards.loader import ShardDataset, make_loader
from vlmshard.shards.reader import ShardError
from vlmshard.shards.records import RecordError
from vlmshard.shards.verify import verify_shards
from vlmshard.shards.config import WriteConfig
from vlmshard.shards.writer import WriteError, run_write

VIRTUAL_RANKS, MICRO = 4, 2


def _pack(stats, out, **kw) -> str:
    run_pack(PackConfig(stats=str(stats), dp=2, virtual_ranks=VIRTUAL_RANKS, micro_batches=MICRO,
                        out=str(out), **kw))
    return str(out)


def _write(plan, stats, out, **kw) -> str:
    run_write(WriteConfig(plan=str(plan), stats=str(stats), out=str(out),
                          shard_bytes=kw.pop("shard_bytes", "8MB"), workers=kw.pop("workers", 1),
                          **kw))
    return str(out)


def _tars(root) -> dict[str, bytes]:
    return {k: v for k, v in tree_bytes(root).items() if k != "manifest.json"}


@pytest.fixture(scope="module")
def plan(demo_out, tmp_path_factory):
    return _pack(demo_out, tmp_path_factory.mktemp("plan") / "plan")


@pytest.fixture(scope="module")
def shards(demo_out, plan, tmp_path_factory):
    return _write(plan, demo_out, tmp_path_factory.mktemp("shards") / "shards")


def _stats_rows(demo_out) -> list[dict]:
    return pq.read_table(os.path.join(demo_out, "stats")).to_pylist()


def _summary(records) -> list[tuple]:
    """What identifies a record's content: place, samples and token ids."""
    return [(r.step, r.rank, r.micro, tuple(s["sample_id"] for s in r.samples),
             r.input_ids.tobytes()) for r in records]


# ---------------------------------------------------------------------------------------------
# Writing


def test_shards_hold_exactly_the_plan(shards, plan):
    result = verify_shards(shards, plan=plan)
    assert result.ok, result.problems
    manifest = read_manifest(shards)
    planned = pq.read_table(os.path.join(plan, "plan.parquet")).num_rows
    assert result.samples == planned == sum(s.samples for s in manifest.shards)
    assert manifest.records == manifest.steps * VIRTUAL_RANKS * MICRO
    assert all(len(manifest.rank_shards(r)) > 1 for r in range(VIRTUAL_RANKS))
    for rank in range(VIRTUAL_RANKS):
        assert manifest.coverage_problem(rank) is None
        assert manifest.rank_shards(rank)[-1].end_step == manifest.steps
    assert not os.path.exists(os.path.join(shards, "_work"))


def test_same_bytes_with_more_workers_and_plain_readers_agree(shards, plan, demo_out, tmp_path):
    again = _write(plan, demo_out, tmp_path / "again", workers=2)
    assert tree_bytes(again) == tree_bytes(shards)

    manifest = read_manifest(shards)
    entries = manifest.rank_shards(0)
    member = re.compile(r"^(\d{8}_\d{3})\.(images\.mp|input_ids\.npy|json|labels\.npy)$")
    with tarfile.open(os.path.join(shards, entries[0].path)) as tar:
        infos = tar.getmembers()
    assert infos and all(member.match(i.name) and i.mtime == 0 and i.uid == 0 and i.gid == 0
                         for i in infos)
    per_key = {}
    for i in infos:  # every record has the same four members: generic readers require it
        key, name = member.match(i.name).groups()
        per_key.setdefault(key, []).append(name)
    assert all(names == ["images.mp", "input_ids.npy", "json", "labels.npy"]
               for names in per_key.values())

    import webdataset

    urls = [os.path.join(shards, e.path) for e in entries]
    samples = list(webdataset.WebDataset(urls, shardshuffle=False))
    assert [s["__key__"] for s in samples] == [
        record_key(step, micro) for step in range(manifest.steps) for micro in range(MICRO)]
    for s in samples:
        meta = json.loads(s["json"])
        ids = np.load(__import__("io").BytesIO(s["input_ids.npy"]))
        assert len(ids) == meta["cu_seqlens"][-1] == sum(meta["seq_lens"])
        images = msgpack.unpackb(s["images.mp"])  # the images, and the videos' sampled frames
        assert len(images) == sum(len(sample["images"]) + sum(len(v["frames"]) for v in
                                                               sample.get("videos", ()))
                                  for sample in meta["samples"])
        for data in images:
            with Image.open(__import__("io").BytesIO(data)) as im:
                im.load()  # the original encoded bytes, whole


def test_a_second_job_on_the_same_folder_is_refused_and_the_first_ends_identical(
        shards, plan, demo_out, tmp_path):
    out = tmp_path / "shared"
    first = subprocess.Popen([sys.executable, "-m", "vlmshard.cli", "write", "--plan", plan,
                              "--stats", str(demo_out), "--out", str(out),
                              "--shard-bytes", "8MB", "--workers", "1"], cwd=REPO,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    job = out / "_work" / "job.json"
    while not job.exists() and first.poll() is None:
        time.sleep(0.005)
    assert first.poll() is None, "the first write finished before a second could start"
    with pytest.raises(WriteError, match=rf"{out} is in use by another vlmshard job \(pid "
                                         rf"{first.pid} on {re.escape(socket.gethostname())}"):
        _write(plan, demo_out, out)
    assert first.wait(timeout=300) == 0, first.stderr.read()
    assert tree_bytes(out) == tree_bytes(shards)
    assert _write(plan, demo_out, out) == str(out)  # free again once the first has ended


def test_write_resumes_after_kill_9_to_the_same_bytes(shards, plan, demo_out, tmp_path):
    out = tmp_path / "crashed"
    args = ["write", "--plan", plan, "--stats", str(demo_out), "--out", str(out),
            "--shard-bytes", "8MB", "--workers", "1"]
    done = lambda: glob.glob(str(out / "_work" / "done" / "*.json"))  # noqa: E731
    kill_9_when(*args, ready=lambda: len(done()) >= 2)
    assert not (out / "manifest.json").exists(), "write finished before it could be killed"
    n_before = len(done())

    result = json.loads(vlmshard(*args, "--json").stdout)
    assert result["shards_resumed"] >= n_before
    assert tree_bytes(out) == tree_bytes(shards)
    assert "already complete" in vlmshard(*args).stdout
    other = vlmshard(*args[:-4], "--shard-bytes", "4MB", check=False)
    assert other.returncode != 0 and "a finished job with other inputs" in other.stderr


def test_retokenized_shards_equal_kept_tokens(demo, demo_out, plan, shards, tmp_path):
    pre = tmp_path / "pre"
    run_preprocess(PreprocessConfig(inputs=[demo.meta], out=str(pre), keep_tokens=False,
                                    workers=1, max_seq_len=8192, part_size=64))
    plan2 = _pack(pre, tmp_path / "plan")
    assert (open(os.path.join(plan2, "plan.parquet"), "rb").read()
            == open(os.path.join(plan, "plan.parquet"), "rb").read())
    assert _tars(_write(plan2, pre, tmp_path / "shards")) == _tars(shards)


def test_write_names_the_sample_whose_image_vanished(demo, tmp_path):
    images = tmp_path / "images"
    images.mkdir()
    photos = sorted(glob.glob(os.path.join(demo.root, "images", "*.jpg")))[:2]
    for name, src in zip(("a.jpg", "b.jpg"), photos):
        shutil.copy(src, images / name)
    rows = [{"image": f"images/{name}", "conversations": [
        {"from": "human", "value": "<image>\nWhat is this?"}, {"from": "gpt", "value": "A photo."}]}
        for name in ("a.jpg", "a.jpg", "b.jpg")]
    with open(tmp_path / "tiny.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    run_preprocess(PreprocessConfig(inputs=[str(tmp_path / "tiny.jsonl")],
                                    out=str(tmp_path / "pre"), keep_tokens=True, workers=1))
    run_pack(PackConfig(stats=str(tmp_path / "pre"), dp=1, out=str(tmp_path / "plan"),
                        target_samples=1))
    os.unlink(images / "b.jpg")
    with pytest.raises(WriteError, match=r"sample 2 \(tiny row 2\): image vanished since "
                                         r"preprocessing: .*b\.jpg"):
        _write(tmp_path / "plan", tmp_path / "pre", tmp_path / "shards")


def test_write_refuses_stats_the_plan_was_not_made_from(plan, tmp_path, demo_out):
    other = tmp_path / "other"
    shutil.copytree(demo_out, other)
    part = sorted(glob.glob(str(other / "stats" / "*.parquet")))[0]
    table = pq.read_table(part)
    pq.write_table(table.slice(0, table.num_rows - 1), part)
    proc = vlmshard("write", "--plan", plan, "--stats", str(other), "--out",
                    str(tmp_path / "s"), check=False)
    assert proc.returncode != 0 and "is not the stats table" in proc.stderr


@pytest.mark.slow
def test_ray_engine_writes_the_same_bytes(ray_cluster, plan, demo_out, shards, tmp_path):
    out = _write(plan, demo_out, tmp_path / "ray", engine="ray", ray_address=ray_cluster,
                 workers=None)
    assert tree_bytes(out) == tree_bytes(shards)


# ---------------------------------------------------------------------------------------------
# Loading


def test_collated_micro_batch_golden(shards, demo_out):
    ds = ShardDataset(shards, rank=0, world_size=VIRTUAL_RANKS)
    record = next(ds.records())
    batch = ds.collate(record)
    m = ds.manifest
    stats = _stats_rows(demo_out)
    samples = [stats[s["sample_id"]] for s in record.samples]
    lens = [s["seq_len"] for s in samples]
    n = sum(lens)
    ids = np.concatenate([s["input_ids"] for s in samples])
    labels = np.concatenate([s["labels"] for s in samples])
    assert batch["input_ids"].shape == batch["labels"].shape == (m.qt,) and n < m.qt

    assert batch["input_ids"][:n].tolist() == ids.tolist()
    assert (batch["input_ids"][n:] == m.pad_token_id).all()
    assert batch["labels"][:n].tolist() == labels.tolist()
    assert (batch["labels"][n:] == -100).all()
    assert int((batch["labels"] != -100).sum()) == sum(s["loss_tokens"] for s in samples)

    bounds = np.cumsum([0] + lens).tolist()
    assert batch["cu_seqlens"].tolist() == bounds + [m.qt]
    for start, end in zip(bounds[:-1], bounds[1:]):
        assert batch["position_ids"][start:end].tolist() == list(range(end - start))
    assert batch["position_ids"][n:].tolist() == list(range(m.qt - n))

    mask = batch["image_token_mask"]
    assert mask[:n].tolist() == (ids == m.image_token_id).tolist() and not mask[n:].any()
    tiles = sum(t for s in samples for t in s["image_tiles"])
    assert batch["num_tiles"] == tiles and int(mask.sum()) == tiles * 256
    assert (batch["labels"][mask] == -100).all()

    # The first sample's first image, cut by the published InternVL procedure, normalized.
    first = samples[0]
    with Image.open(first["image_paths"][0]) as im:
        expected = ref.internvl_pixels(im.convert("RGB"),
                                       m.tiling[first["source"]]["max_patches"])
    np.testing.assert_allclose(batch["pixel_values"][:len(expected)].numpy(), expected, atol=1e-5)
    assert batch["pixel_values"].shape == (m.qv, 3, 448, 448)
    assert not batch["pixel_values"][tiles:].any()


def test_world_sizes_dividing_the_virtual_ranks_merge_step_by_step(shards):
    per_vrank = {v: _summary(ShardDataset(shards, v, VIRTUAL_RANKS).records())
                 for v in range(VIRTUAL_RANKS)}
    steps = read_manifest(shards).steps
    for world in (1, 2):
        for rank in range(world):
            vranks = range(rank * VIRTUAL_RANKS // world, (rank + 1) * VIRTUAL_RANKS // world)
            expected = [per_vrank[v][s * MICRO + m] for s in range(steps) for v in vranks
                        for m in range(MICRO)]
            ds = ShardDataset(shards, rank, world)
            assert ds.micro_batches_per_step == MICRO * len(vranks)
            assert _summary(ds.records()) == expected
    with pytest.raises(ConfigError, match=r"world size 3 does not divide it \(use one of "
                                         r"\[1, 2, 4\]"):
        ShardDataset(shards, 0, 3)


def test_dataloader_workers_and_resume_are_exact(shards):
    def run(start_step=0, workers=0):
        loader = make_loader(shards, rank=1, world_size=VIRTUAL_RANKS, start_step=start_step,
                             num_workers=workers)
        return [(b["step"], b["micro"], tuple(b["sample_ids"].tolist()),
                 float(b["pixel_values"].double().sum())) for b in loader]

    reference = run()
    per_step = MICRO
    assert len(reference) == read_manifest(shards).steps * per_step
    assert run(workers=2) == reference
    k = len(reference) // per_step // 2
    assert run(start_step=k) == reference[k * per_step:]


def _rchar() -> int:
    """Bytes this process has read through read(2) so far (the kernel's own count)."""
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


def test_workers_seek_to_their_own_records_and_read_them_once(shards):
    manifest = read_manifest(shards)
    # The manifest's offsets and CRCs, recomputed from the tar headers with tarfile.
    for entry in manifest.shards:
        path = os.path.join(shards, entry.path)
        with tarfile.open(path) as tar:
            members = tar.getmembers()
        starts = [m.offset for k, m in enumerate(members)
                  if k == 0 or members[k - 1].name.split(".")[0] != m.name.split(".")[0]]
        last = members[-1]
        ends = starts[1:] + [last.offset_data + -(-last.size // 512) * 512]
        assert entry.offsets == starts + ends[-1:]
        with open(path, "rb") as f:
            data = f.read()
        assert entry.crc32 == [zlib.crc32(data[a:b]) for a, b in zip(starts, ends)]

    ds = ShardDataset(shards, 0, 1)
    reference = _summary(ds.records())
    for root in (shards, f"file://{shards}"):
        ds = ShardDataset(root, 0, 1)
        assert ds.seekable, root
        parts = [_summary(ds.worker_records(w, 3)) for w in range(3)]
        merged = [parts[i % 3][i // 3] for i in range(len(reference))]
        assert merged == reference, root
    # Each of two workers reads about half the bytes; one reader streams them all.
    read = []
    for worker, workers in ((0, 2), (1, 2), (0, 1)):
        before = _rchar()
        list(ds.worker_records(worker, workers))
        read.append(_rchar() - before)
    assert read[0] + read[1] < 1.1 * manifest.bytes and max(read[:2]) < 0.65 * manifest.bytes
    assert read[2] >= manifest.bytes
    with serve_http(shards) as url:  # ranged reads, as from an object store
        assert ShardDataset(url, 0, 1).seekable
        assert _summary(ShardDataset(url, 0, 1).worker_records(1, 2)) == reference[1::2]
    piped = ShardDataset(f"pipe:cat {shards}/{{path}}", 0, 1)
    assert not piped.seekable  # a stream: each worker reads it all, keeps its own
    assert _summary(piped.worker_records(1, 2)) == reference[1::2]


def test_streams_from_http_pipe_and_fsspec_like_the_folder(shards):
    folder = ShardDataset(shards, 0, 1)
    reference = _summary(folder.records())
    first = folder.collate(next(folder.records()))
    with serve_http(shards) as url:
        for root in (url, f"pipe:cat {shards}/{{path}}", f"file://{shards}"):
            ds = ShardDataset(root, 0, 1)
            assert _summary(ds.records()) == reference, root
            batch = ds.collate(next(ds.records()))
            assert all(torch.equal(batch[k], first[k]) if torch.is_tensor(first[k])
                       else batch[k] == first[k] for k in first), root


# ---------------------------------------------------------------------------------------------
# Corruption


def _copy(shards, tmp_path, name):
    out = tmp_path / name
    shutil.copytree(shards, out)
    entry = read_manifest(str(out)).rank_shards(1)[0]
    return str(out), entry, os.path.join(out, entry.path)


def _image_data_offset(tar_path: str) -> tuple[int, str]:
    with tarfile.open(tar_path) as tar:
        info = next(i for i in tar.getmembers() if i.name.endswith(".images.mp") and i.size > 1024)
        return info.offset_data + info.size // 2, info.name.split(".")[0]


def test_a_flipped_byte_is_named_by_verify_and_the_loader(shards, tmp_path):
    root, entry, path = _copy(shards, tmp_path, "flip")
    offset, key = _image_data_offset(path)
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))
    proc = vlmshard("verify", root, check=False)
    assert proc.returncode == 1
    assert f"{entry.path}: record {key}: member" in proc.stdout and "CRC-32" in proc.stdout
    with pytest.raises(RecordError, match=re.escape(entry.path) + f": record {key}: member"):
        list(ShardDataset(root, 1, VIRTUAL_RANKS).records())
    ds = ShardDataset(root, 1, VIRTUAL_RANKS)
    with pytest.raises(ShardError, match=re.escape(entry.path) + f": record {key}: its bytes "
                                         "differ from the manifest's per-record CRC-32"):
        for worker in (0, 1):
            list(ds.worker_records(worker, 2))


def test_a_truncated_tar_is_named_by_verify_and_the_loader(shards, tmp_path):
    root, entry, path = _copy(shards, tmp_path, "cut")
    with open(path, "r+b") as f:
        f.truncate(entry.bytes // 2)
    result = verify_shards(root)
    assert not result.ok and any(entry.path in p and "record" in p for p in result.problems)
    assert not verify_shards(root, quick=True).ok
    with pytest.raises(ShardError, match=re.escape(entry.path) + r": (truncated|\d+ record)"):
        list(ShardDataset(root, 1, VIRTUAL_RANKS).records())


def test_a_deleted_shard_is_named_by_verify_and_the_loader(shards, tmp_path):
    root, entry, path = _copy(shards, tmp_path, "gone")
    os.unlink(path)
    for quick in (False, True):
        result = verify_shards(root, quick=quick)
        assert not result.ok and any(entry.path in p for p in result.problems)
    with pytest.raises(ShardError, match=re.escape(entry.path) + ": cannot open shard"):
        list(ShardDataset(root, 1, VIRTUAL_RANKS).records())


def test_verify_decodes_recurring_image_bytes_once_and_a_bad_copy_still_fails(monkeypatch):
    """``decoded_images`` with ``known`` (``verify``'s): bytes decoded in full once are read to
    their header when they recur (Pillow's full decodes counted); other bytes, a truncated copy
    of the same image among them, are decoded, and fail."""
    import io

    from PIL import ImageFile

    from vlmshard.families.internvl import InternVLTiling
    from vlmshard.shards.records import Record, decoded_images

    full = []
    load = ImageFile.ImageFile.load
    monkeypatch.setattr(ImageFile.ImageFile, "load", lambda im: full.append(1) or load(im))
    buffer = io.BytesIO()
    Image.new("RGB", (448, 224), (200, 30, 30)).save(buffer, "PNG")
    png = buffer.getvalue()
    policy = InternVLTiling()

    def record(images: list[bytes]) -> Record:
        return Record(shard="test", key="000000000_000", step=0, rank=0, micro=0,
                      samples=[{"sample_id": i, "source": "rows", "images": [f"{i}.img"],
                                "image_tiles": [policy.tiles(448, 224, 1)]}
                               for i in range(len(images))],
                      input_ids=np.zeros(0, np.int32), labels=np.zeros(0, np.int32),
                      images=images, cu_seqlens=[0])

    known: set[bytes] = set()
    seen = [(d.width, d.height) for d in decoded_images(record([png] * 3), {"rows": policy},
                                                        rgb=False, known=known)]
    assert seen == [(448, 224)] * 3 and len(full) == 1 and len(known) == 1
    with pytest.raises(RecordError, match="image 1.img does not decode"):
        list(decoded_images(record([png, png[:len(png) // 2]]), {"rows": policy}, rgb=False,
                            known=known))
    assert len(full) == 2 and len(known) == 2  # the copy alone decoded


def test_verify_names_a_plan_that_differs(shards, demo_out, tmp_path):
    other = _pack(demo_out, tmp_path / "other", seed=1)
    proc = vlmshard("verify", shards, "--plan", other, check=False)
    assert proc.returncode == 1 and "not the plan these shards were written from" in proc.stdout


class InjectedBug(Exception):
    """What a bug in our own code raises: no handler of a data error may take it."""


def _raise_bug(*args, **kwargs):
    raise InjectedBug("a bug in our own code")


def test_a_bug_in_our_own_code_stops_the_job_and_is_never_a_data_error(
        demo_out, plan, shards, tmp_path, monkeypatch):
    """A bug (an exception from our own function) in the record decoder, in the writer's image
    read and in preprocess's image read stops the job with that exception, rather than read as
    a truncated tar, a vanished image or a missing_image reject."""
    import vlmshard.preprocess.images
    import vlmshard.shards.reader
    import vlmshard.shards.writer

    monkeypatch.setattr(vlmshard.shards.reader, "decode_record", _raise_bug)
    with pytest.raises(InjectedBug):
        next(iter(ShardDataset(shards, 0, 1).records()))

    monkeypatch.setattr(vlmshard.shards.writer, "read_bytes", _raise_bug)
    with pytest.raises(InjectedBug):
        _write(plan, demo_out, tmp_path / "shards")

    photo = tmp_path / "cat.png"
    Image.new("RGB", (32, 32)).save(photo)
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"image": f"file://{photo}", "conversations": [
        {"from": "human", "value": "<image>\nWhat?"}, {"from": "gpt", "value": "A cat."}]}))
    monkeypatch.setattr(vlmshard.preprocess.images, "read_bytes", _raise_bug)
    with pytest.raises(InjectedBug):
        run_preprocess(PreprocessConfig(inputs=[str(rows)], out=str(tmp_path / "pre"), workers=1))
