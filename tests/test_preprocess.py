"""The preprocess stage end to end on the demo data: counts reconcile, every bad row gets its
reason, output bytes are deterministic across worker counts, and every input format is read."""

from __future__ import annotations

import json
import os

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import tree_bytes, vlmshard

from vlmshard.preprocess import ConfigError, PreprocessConfig, RejectRatioExceeded, run_preprocess


def _run(demo, out, **kw):
    kw.setdefault("max_seq_len", 8192)
    kw.setdefault("part_size", 64)
    return run_preprocess(PreprocessConfig(inputs=[demo.meta], out=str(out), **kw))


def _stats(out) -> pa.Table:
    return pq.read_table(os.path.join(out, "stats"))


def test_counts_reconcile_per_source_and_reason(demo_out):
    report = json.load(open(demo_out / "preprocess.json"))
    stats, rejects = _stats(demo_out), pq.read_table(demo_out / "rejects.parquet")
    totals = report["totals"]
    assert totals["input_rows"] == totals["accepted"] + totals["rejected"]
    assert (totals["accepted"], totals["rejected"]) == (stats.num_rows, rejects.num_rows)
    for name, src in report["sources"].items():
        assert src["input_rows"] == src["accepted"] + src["rejected"], name
        assert src["accepted"] == stats.filter(pa.compute.equal(stats["source"], name)).num_rows
        assert sum(src["by_reason"].values()) == src["rejected"]
    # chat has repeat_time 0.5 in the meta file: exactly half of its 40 rows, chosen by seed.
    assert report["sources"]["chat"]["input_rows"] == 20


def test_each_bad_row_gets_its_reason(demo, demo_out):
    expected = {}
    with open(os.path.join(demo.root, "noisy.jsonl"), "rb") as f:
        for row, line in enumerate(f):
            start = line.find(b'"id": "') + 7
            expected[row] = line[start:line.index(b'"', start)].decode()
    rejects = pq.read_table(demo_out / "rejects.parquet").to_pylist()
    got = {r["row"]: r["reason"] for r in rejects if r["source"] == "noisy"}
    want = {row: reason for row, reason in expected.items() if not reason.startswith("accepted")}
    assert got == want
    assert all(r["message"] for r in rejects)
    accepted_rows = _stats(demo_out).filter(pa.compute.equal(_stats(demo_out)["source"], "noisy"))
    assert sorted(accepted_rows["row"].to_pylist()) == \
        [row for row, reason in expected.items() if reason.startswith("accepted")]


def test_stats_table_contract(demo_out):
    t = _stats(demo_out)
    rows = t.to_pylist()
    assert [r["sample_id"] for r in rows] == list(range(len(rows)))
    order = ["captions", "docqa", "multi", "chat", "noisy", "hub", "clips"]
    keys = [(order.index(r["source"]), r["row"]) for r in rows]
    assert keys == sorted(keys)
    for r in rows:
        assert r["n_images"] == len(r["image_tiles"]) == len(r["image_paths"]) \
            == len(r["image_sizes"])
        # a video's frames are 448-px tiles of 256 tokens each, as InternVL (the demo) has them
        assert r["vit_tiles"] == sum(r["image_tiles"]) + sum(len(v["frames"]) for v in r["videos"])
        assert r["seq_len"] == r["text_tokens"] + 256 * r["vit_tiles"] == len(r["input_ids"])
        assert r["loss_tokens"] == sum(1 for label in r["labels"] if label != -100) > 0
        if r["source"] == "hub":  # embedded: named by the row's own path for them
            assert all(p.startswith("embedded:") for p in r["image_paths"]), r["image_paths"]
        else:
            assert all(os.path.isabs(p) and os.path.exists(p) for p in r["image_paths"])
    assert {r["n_images"] for r in rows} >= {0, 1, 2, 3, 4}
    videos = [v for r in rows for v in r["videos"]]
    assert len(videos) >= 20 and {v["frame_list"] for v in videos} == {False, True}
    assert any(p.startswith("embedded:") for v in videos for p in v["paths"])


def test_bytes_identical_for_1_and_2_workers(demo, demo_out, tmp_path):
    _run(demo, tmp_path / "two", keep_tokens=True, workers=2)
    assert tree_bytes(tmp_path / "two") == tree_bytes(demo_out)


def test_finished_job_rerun_is_a_noop(demo, demo_out, monkeypatch):
    """A finished job's rerun writes nothing and builds no tokenizer (the builder is replaced by
    one that fails); other options are refused."""
    from vlmshard.preprocess import job

    def built(*args, **kwargs):
        raise AssertionError("encoder built")

    before = {n: os.stat(os.path.join(demo_out, "stats", n)).st_mtime_ns
              for n in os.listdir(demo_out / "stats")}
    with monkeypatch.context() as patched:
        patched.setattr(job, "make_encoder", built)
        result = _run(demo, demo_out, keep_tokens=True, workers=1)
    assert result.already_complete
    assert before == {n: os.stat(os.path.join(demo_out, "stats", n)).st_mtime_ns
                      for n in os.listdir(demo_out / "stats")}
    with pytest.raises(ConfigError, match="finished job with other inputs or config"):
        _run(demo, demo_out, keep_tokens=False, workers=1)


def test_a_tokenizer_that_does_not_load_is_one_error_before_the_job_claims_out(demo, tmp_path):
    """The folder is checked before ``OUT`` is claimed: once fixed, the same command runs (an
    interrupted job's record would name the broken folder's bytes and refuse it)."""
    from vlmshard.demo import data as demo_data

    model = demo_data.demo_model("internvl", str(tmp_path / "model"))
    tokenizer = os.path.join(model, "tokenizer.json")
    good = open(tokenizer, "rb").read()
    with open(tokenizer, "wb") as f:
        f.write(b"{not json")
    captions = os.path.join(demo.root, "captions.jsonl")
    cfg = PreprocessConfig(inputs=[captions], out=str(tmp_path / "o"), model=model, workers=1)
    with pytest.raises(ConfigError, match="the tokenizer does not load"):
        run_preprocess(cfg)
    assert not os.path.exists(tmp_path / "o" / "_work" / "job.json")
    with open(tokenizer, "wb") as f:
        f.write(good)
    assert run_preprocess(cfg).accepted == 80


def test_demo_data_and_model_are_reused_when_unchanged(demo, tmp_path, monkeypatch):
    """A rerun of ``demo-data`` or ``demo-model`` with the same inputs over untouched files
    builds nothing (the builders are replaced by ones that fail) and returns the same result,
    wherever the folder now lies; a file changed since is built again, to the same bytes."""
    import shutil

    import vlmshard.families
    from vlmshard.demo import data as demo_data

    copy = str(tmp_path / "data")
    shutil.copytree(demo.root, copy)
    model = demo_data.demo_model("internvl", str(tmp_path / "model"))
    built = tree_bytes(copy), tree_bytes(model)

    def rebuilt(*args, **kwargs):
        raise AssertionError("built again")

    with monkeypatch.context() as patched:
        patched.setattr(demo_data, "_generate", rebuilt)
        patched.setattr(vlmshard.families, "tiny_folder", rebuilt)
        again = demo_data.generate(copy, seed=0)
        assert (again.images, again.sources) == (demo.images, demo.sources)
        assert again.meta == os.path.join(copy, "meta.json")
        assert demo_data.demo_model("internvl", model) == model
        with pytest.raises(AssertionError, match="built again"):
            demo_data.generate(copy, seed=1)  # other inputs
    os.unlink(os.path.join(copy, demo.images[0]))
    with open(os.path.join(model, "config.json"), "a") as f:
        f.write(" ")
    demo_data.generate(copy, seed=0)
    demo_data.demo_model("internvl", model)
    # by name: which file came back other (once in many runs one did; preprocess/clips.py)
    differ = [name for now, then in zip((tree_bytes(copy), tree_bytes(model)), built)
              for name in sorted(set(now) | set(then)) if now.get(name) != then.get(name)]
    assert not differ, f"rebuilt to other bytes: {differ}"


def test_every_input_format_gives_the_same_rows(demo, tmp_path):
    """The captions source as JSON list, JSONL, Parquet and a saved HF dataset."""
    rows = [json.loads(line) for line in open(os.path.join(demo.root, "captions.jsonl"))][:30]
    paths = {"jsonl": tmp_path / "c.jsonl", "json": tmp_path / "c.json",
             "parquet": tmp_path / "c.parquet", "hf": tmp_path / "c_hf"}
    paths["jsonl"].write_text("".join(json.dumps(r) + "\n" for r in rows))
    paths["json"].write_text(json.dumps(rows))
    pq.write_table(pa.Table.from_pylist(rows), paths["parquet"])
    datasets.Dataset.from_list(rows).save_to_disk(str(paths["hf"]))
    columns = ["row", "image_tiles", "seq_len", "loss_tokens", "image_paths"]
    results = {}
    for kind, path in paths.items():
        out = tmp_path / f"out-{kind}"
        run_preprocess(PreprocessConfig(inputs=[str(path)], out=str(out), image_root=demo.root,
                                        workers=1))
        results[kind] = _stats(out).select(columns).to_pylist()
    assert len(results["jsonl"]) == 30
    assert all(results[k] == results["jsonl"] for k in results)


def test_meta_repeat_time_above_one_repeats(demo, tmp_path):
    meta = {"twice": {"root": demo.root, "annotation": os.path.join(demo.root, "captions.jsonl"),
                      "repeat_time": 2},
            "third": {"root": demo.root, "annotation": os.path.join(demo.root, "docqa.json"),
                      "repeat_time": 0.3, "max_dynamic_patch": 4}}
    path = tmp_path / "meta.json"
    path.write_text(json.dumps(meta))
    result = run_preprocess(PreprocessConfig(inputs=[str(path)], out=str(tmp_path / "o"),
                                             workers=1))
    t = _stats(tmp_path / "o")
    twice = t.filter(pa.compute.equal(t["source"], "twice"))["row"].to_pylist()
    assert twice == list(range(80)) * 2
    assert result.input_rows == 160 + 15
    third = t.filter(pa.compute.equal(t["source"], "third"))
    assert max(third["vit_tiles"].to_pylist()) <= 5  # max_dynamic_patch 4 (+ thumbnail)


def test_jsonl_blank_lines_and_json_list_surrogates(tmp_path):
    ok = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}
    (tmp_path / "a.jsonl").write_text("\n" + json.dumps(ok) + "\n   \n" + json.dumps(ok))
    (tmp_path / "b.json").write_text(json.dumps([ok, {"conversations": [
        {"from": "human", "value": "bad \udc80"}, {"from": "gpt", "value": "x"}]}]))
    (tmp_path / "c.json").write_text("[{not json")
    result = run_preprocess(PreprocessConfig(
        inputs=[str(tmp_path / n) for n in ("a.jsonl", "b.json", "c.json")],
        out=str(tmp_path / "o"), workers=1))
    assert (result.input_rows, result.accepted) == (5, 3)
    assert result.rejected_by_reason == {"undecodable_text": 1, "unreadable_source": 1}


def test_max_reject_ratio_fails_loudly(demo, tmp_path):
    noisy = os.path.join(demo.root, "noisy.jsonl")
    with pytest.raises(RejectRatioExceeded, match=r"16 of 18 rows rejected .* top reasons"):
        run_preprocess(PreprocessConfig(inputs=[noisy], out=str(tmp_path / "o"), workers=1,
                                        max_seq_len=8192, max_reject_ratio=0.5))
    proc = vlmshard("preprocess", noisy, "--out", str(tmp_path / "p"), "--max-reject-ratio", "0.1",
                    check=False)
    assert proc.returncode == 3 and "--max-reject-ratio" in proc.stderr


@pytest.mark.parametrize("args, message", [
    (["missing.jsonl"], "input not found: missing.jsonl"),
    (["{captions}", "--model", "/no/such/model"], "--model /no/such/model: no such folder"),
    (["{captions}", "--tiling", "qwen2vl", "--max-patches", "4"],
     "--max-patches applies to InternVL tiling, not qwen2vl"),
    (["{captions}", "--workers", "0"], "--workers must be >= 1"),
    ([], "no input given"),
])
def test_bad_config_fails_at_once_with_one_line(demo, tmp_path, args, message):
    args = [a.format(captions=os.path.join(demo.root, "captions.jsonl")) for a in args]
    proc = vlmshard("preprocess", *args, "--out", str(tmp_path / "o"), check=False)
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0], proc.stderr


def test_config_file_and_flag_override(demo, tmp_path):
    cfg = tmp_path / "pre.yaml"
    cfg.write_text(f"inputs: [{os.path.join(demo.root, 'captions.jsonl')}]\n"
                   f"out: {tmp_path / 'from-yaml'}\ntiling: qwen2vl\nmax_patches: 4\n")
    proc = vlmshard("preprocess", "--config", str(cfg), "--tiling", "internvl", "--json")
    assert json.loads(proc.stdout)["accepted"] == 80
    report = json.load(open(tmp_path / "from-yaml" / "preprocess.json"))
    assert report["config"]["tiling"]["name"] == "internvl"  # the flag wins over the file
    assert report["config"]["tiling"]["max_patches"] == 4  # the file's value, not the default
    bad = tmp_path / "bad.yaml"
    bad.write_text("inputs: [x]\nout: y\ntokeniser: tekken\n")
    proc = vlmshard("preprocess", "--config", str(bad), check=False)
    assert proc.returncode != 0 and "unknown key(s) tokeniser" in proc.stderr


def test_a_folder_in_use_by_another_job_is_refused(demo, tmp_path):
    from vlmshard.jobs import locked_output

    out = tmp_path / "busy"
    cfg = PreprocessConfig(inputs=[os.path.join(demo.root, "captions.jsonl")], out=str(out),
                           workers=1)
    with locked_output(str(out)):  # another job holds the folder (a flock of its own)
        with pytest.raises(ConfigError, match="is in use by another vlmshard job"):
            run_preprocess(cfg)
        assert not (out / "_work").exists()  # refused before touching anything
    assert run_preprocess(cfg).accepted == 80


def test_image_paths_leading_out_of_the_root_are_rejected_unless_allowed(demo, tmp_path):
    import shutil

    root = tmp_path / "data"
    (root / "sub").mkdir(parents=True)
    photo = os.path.join(demo.root, sorted(p for p in demo.images if "tiny" not in p)[0])
    shutil.copy(photo, tmp_path / "secret.png")
    shutil.copy(photo, root / "inside.png")
    turns = [{"from": "human", "value": "<image>\nWhat?"}, {"from": "gpt", "value": "A photo."}]
    rows = [{"image": "../secret.png"}, {"image": "sub/../../secret.png"},
            {"image": "sub/../inside.png"}, {"image": str(tmp_path / "secret.png")}]
    with open(root / "rows.jsonl", "w") as f:
        for row in rows:
            f.write(json.dumps({**row, "conversations": turns}) + "\n")

    run_preprocess(PreprocessConfig(inputs=[str(root / "rows.jsonl")], out=str(tmp_path / "o"),
                                    workers=1))
    rejects = pq.read_table(tmp_path / "o" / "rejects.parquet").to_pylist()
    assert [(r["row"], r["reason"]) for r in rejects] == [(0, "path_outside_root"),
                                                         (1, "path_outside_root")]
    assert "'../secret.png' leads out of the image root" in rejects[0]["message"]
    stats = pq.read_table(tmp_path / "o" / "stats").to_pylist()
    assert [s["image_paths"] for s in stats] == [[str(root / "inside.png")],
                                                 [str(tmp_path / "secret.png")]]

    allowed = run_preprocess(PreprocessConfig(inputs=[str(root / "rows.jsonl")],
                                              out=str(tmp_path / "a"), workers=1,
                                              allow_outside_image_root=True))
    assert (allowed.accepted, allowed.rejected) == (4, 0)


@pytest.mark.parametrize("progressive", [False, True])
def test_jpegs_with_data_after_their_end_are_complete_and_cut_ones_are_not(tmp_path,
                                                                           progressive):
    """Motion Photos append an MP4 after the JPEG's EOI marker, some cameras EXIF: the image is
    whole. A JPEG cut before its EOI is truncated, whatever its last bytes look like."""
    import io

    import numpy as np
    from PIL import Image

    from vlmshard.preprocess.images import read_image_header
    from vlmshard.rejects import Reject

    rng = np.random.default_rng(0)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (120, 160, 3), dtype=np.uint8)).save(
        buf, "JPEG", quality=90, progressive=progressive)
    jpeg = buf.getvalue()
    trailer = b"\x00\x00\x00\x18ftypmp42" + bytes(rng.integers(0, 255, 4096, dtype=np.uint8))
    trailer = trailer.replace(b"\xff\xd9", b"\xff\x00")  # no EOI look-alike near the end
    cases = {"plain.jpg": jpeg, "motion.jpg": jpeg + trailer,
             "cut.jpg": jpeg[:len(jpeg) * 2 // 3],
             "cut-with-tail.jpg": jpeg[:len(jpeg) * 2 // 3] + trailer}
    for name, data in cases.items():
        (tmp_path / name).write_bytes(data)
    for name in ("plain.jpg", "motion.jpg"):
        assert read_image_header(str(tmp_path / name)).width == 160
    for name in ("cut.jpg", "cut-with-tail.jpg"):
        with pytest.raises(Reject) as e:
            read_image_header(str(tmp_path / name))
        assert e.value.reason == "truncated_image", name
