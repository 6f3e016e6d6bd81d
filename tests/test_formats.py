"""The data users hold: every row format and container gives the same samples as the same
conversations written as LLaVA rows with image files; embedded images reach the shards byte for
byte; bad rows get their reasons; a job that accepts nothing says what the rows look like.

Everything is built here, offline, with ``datasets`` and Pillow."""

from __future__ import annotations

import base64
import glob
import json
import os
import shutil
import tarfile

import datasets
import msgpack
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import vlmshard

from vlmshard.families import tiny_folder
from vlmshard.packing.config import PackConfig
from vlmshard.packing.plan import run_pack
from vlmshard.preprocess import ConfigError, NothingAccepted, PreprocessConfig, run_preprocess
from vlmshard.shards.config import WriteConfig
from vlmshard.shards.writer import run_write

PHOTOS = ("astronaut.png", "rocket.jpg", "chelsea.png", "coffee.png")
ROLE_FROM = {"user": "human", "assistant": "gpt", "system": "system"}
# Conversations as (images, turns); a turn's parts are text or the index of one of its images.
# No text starts with a line break after an image: in a string, a template that puts its own
# after an image drops the data's (InternVL), in a content list it does not ("\n\n"); that
# rule is checked against each family's own rendering in test_families.py.
CONVERSATIONS = [
    ([0, 1], [("system", ["Answer briefly."]),
              ("user", [0, "First. ", 1, "Second?"]),
              ("assistant", ["A person and a rocket."]),
              ("user", ["Which is taller?"]),
              ("assistant", ["The rocket."])]),
    ([2], [("user", [0, "What animal is this?"]), ("assistant", ["A cat."])]),
    ([], [("user", ["Hello there"]),
          ("assistant", ["Hi! ünïcödé 漢字 😀\n\n  how can I help?"])]),
    ([3], [("user", ["Look: ", 0, " What is in the cup?\n"]), ("assistant", ["Coffee."])]),
]


def _photo(name: str) -> str:
    import skimage

    return os.path.join(os.path.dirname(skimage.__file__), "data", name)


def _bytes(name: str) -> bytes:
    with open(_photo(name), "rb") as f:
        return f.read()


def _joined(parts: list) -> str:
    return "".join("<image>" if isinstance(p, int) else p for p in parts)


def _llava(images, turns) -> dict:
    return {"image": [_photo(PHOTOS[i]) for i in images],
            "conversations": [{"from": ROLE_FROM[r], "value": _joined(p)} for r, p in turns]}


def _messages(images, turns, image=lambda i: _photo(PHOTOS[i])) -> dict:
    return {"images": [image(i) for i in images],
            "messages": [{"role": r, "content": _joined(p)} for r, p in turns]}


def _typed(images, turns, item) -> dict:
    """Content lists; text-only turns stay strings (both are what apply_chat_template takes)."""
    def content(parts):
        if not any(isinstance(p, int) for p in parts):
            return _joined(parts)
        return [item(images[p]) if isinstance(p, int) else {"type": "text", "text": p}
                for p in parts]

    return {"messages": [{"role": r, "content": content(p)} for r, p in turns]}


def _embedded(i: int) -> dict:
    return {"bytes": _bytes(PHOTOS[i]), "path": PHOTOS[i]}


def _data_uri(i: int) -> str:
    return "data:image/png;base64," + base64.b64encode(_bytes(PHOTOS[i])).decode()


FEATURES = datasets.Features({
    "images": datasets.Sequence(datasets.Image()),
    "messages": [{"role": datasets.Value("string"), "content": datasets.Value("string")}]})


def _hub_dataset(rows: list[dict]) -> datasets.Dataset:
    return datasets.Dataset.from_list(rows, features=FEATURES)


def _write_jsonl(path, rows: list[dict]) -> str:
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return str(path)


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, list[str]]:
    """Each format's inputs (and extra preprocess options), same conversations."""
    root = tmp_path_factory.mktemp("formats")
    embedded = [_messages(im, t, _embedded) for im, t in CONVERSATIONS]
    hub = _hub_dataset(embedded)
    hub.to_parquet(str(root / "hub.parquet"), batch_size=2)  # two rows per row group
    hub.save_to_disk(str(root / "saved"))
    datasets.DatasetDict({"train": hub, "test": hub.select([0])}).save_to_disk(str(root / "dd"))
    return {
        "llava": [_write_jsonl(root / "llava.jsonl", [_llava(*c) for c in CONVERSATIONS])],
        "messages": [_write_jsonl(root / "messages.jsonl",
                                  [_messages(*c) for c in CONVERSATIONS])],
        "content_list": [_write_jsonl(root / "typed.jsonl", [_typed(*c, lambda i: {
            "type": "image", "image": _photo(PHOTOS[i])}) for c in CONVERSATIONS])],
        "openai_data_uri": [_write_jsonl(root / "openai.jsonl", [_typed(*c, lambda i: {
            "type": "image_url", "image_url": {"url": _data_uri(i)}}) for c in CONVERSATIONS])],
        "parquet_embedded": [str(root / "hub.parquet")],
        "arrow": glob.glob(str(root / "saved" / "*.arrow")),
        "save_to_disk": [str(root / "saved")],
        "dataset_dict": [str(root / "dd"), "--split", "train"],
    }


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("models")
    return {name: tiny_folder(name, str(root / name), **sizes)
            for name, sizes in (("qwen2_vl", {"max_pixels": 28 * 28 * 64}),
                                ("internvl", {"max_patches": 4}), ("qwen3_vl", {}))}


def _preprocess(args: list[str], out, **options):
    inputs = [a for a in args if not a.startswith("--")]
    split = args[args.index("--split") + 1] if "--split" in args else None
    inputs = [a for a in inputs if a != split]
    return run_preprocess(PreprocessConfig(inputs=inputs, out=str(out), workers=1, split=split,
                                           **options))


SAME = ("input_ids", "labels", "image_tiles", "seq_len", "text_tokens", "loss_tokens",
        "image_sizes", "image_bytes")


@pytest.mark.parametrize("model_type", ["qwen2_vl", "internvl"])
def test_every_format_gives_the_samples_of_llava_rows(sources, folders, model_type, tmp_path):
    def stats(name):
        result = _preprocess(sources[name], tmp_path / name, model=folders[model_type],
                             keep_tokens=True)
        assert (result.accepted, result.rejected) == (len(CONVERSATIONS), 0), name
        return pq.read_table(tmp_path / name / "stats", columns=list(SAME)).to_pylist()

    want = stats("llava")
    assert [r["image_bytes"] for r in want] == [
        [os.path.getsize(_photo(PHOTOS[i])) for i in im] for im, _ in CONVERSATIONS]
    for name in sources:
        if name != "llava":
            assert stats(name) == want, name


def test_embedded_images_are_named_and_read_from_the_row(sources, tmp_path):
    _preprocess(sources["parquet_embedded"], tmp_path / "o")
    paths = pq.read_table(tmp_path / "o" / "stats", columns=["image_paths"]).column(0).to_pylist()
    assert paths == [[f"embedded:{PHOTOS[i]}" for i in im] for im, _ in CONVERSATIONS]


def test_content_lists_render_as_the_template_renders_them(folders, tmp_path):
    """Literal ``<image>`` text in a text item stays text; a text-only list turn is a list."""
    from transformers import AutoTokenizer

    folder = folders["qwen2_vl"]
    messages = [{"role": "user", "content": [
                    {"type": "text", "text": "Is <image> a tag?"},
                    {"type": "image", "image": _photo("coffee.png")},
                    {"type": "text", "text": "\nAnswer."}]},
                {"role": "assistant", "content": [{"type": "text", "text": "Yes."}]}]
    path = _write_jsonl(tmp_path / "rows.jsonl", [{"messages": messages}])
    run_preprocess(PreprocessConfig(inputs=[path], out=str(tmp_path / "o"), model=folder,
                                    workers=1, keep_tokens=True))
    (sample,) = pq.read_table(tmp_path / "o" / "stats").to_pylist()
    tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    rendered = tok.apply_chat_template([{"role": m["role"], "content": [
        {"type": c["type"], **({"text": c["text"]} if c["type"] == "text" else {})}
        for c in m["content"]]} for m in messages], tokenize=False)
    n = sample["seq_len"] - sample["text_tokens"]
    assert tok.decode(sample["input_ids"]) == rendered.replace("<|image_pad|>",
                                                               "<|image_pad|>" * n)
    assert sample["input_ids"].count(tok.convert_tokens_to_ids("<|image_pad|>")) == n


def _record_images(out) -> dict[tuple[int, int], list[bytes]]:
    """(row, image k) -> bytes, read from the tars with tarfile and msgpack alone."""
    found = {}
    for path in sorted(glob.glob(os.path.join(out, "rank-*", "*.tar"))):
        with tarfile.open(path) as tar:
            members = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}
        for name, data in members.items():
            if not name.endswith(".json"):
                continue
            meta = json.loads(data)
            images = iter(msgpack.unpackb(members[name[:-len("json")] + "images.mp"]))
            for sample in meta["samples"]:
                found[sample["row"]] = [next(images) for _ in sample["images"]]
    return found


@pytest.mark.parametrize("keep_tokens", [True, False])
def test_embedded_bytes_reach_the_shards_unchanged(sources, tmp_path, keep_tokens):
    path = sources["parquet_embedded"][0]
    pre, plan, shards = (str(tmp_path / n) for n in ("pre", "plan", "shards"))
    _preprocess([path], pre, keep_tokens=keep_tokens)
    run_pack(PackConfig(stats=pre, dp=1, micro_batches=1, out=plan))
    run_write(WriteConfig(plan=plan, stats=pre, out=shards, workers=1))
    source = pq.read_table(path).to_pylist()
    want = {row: [image["bytes"] for image in r["images"]] for row, r in enumerate(source)}
    assert _record_images(shards) == want


def test_bad_rows_get_their_reasons_and_reconcile(tmp_path):
    good = _messages([0], [("user", ["<image>What?"]), ("assistant", ["A person."])], _embedded)
    rows = {
        "accepted": good,
        "corrupt_image": {**good, "images": [{"bytes": b"\x89PNG\r\n\x1a\nnot an image",
                                              "path": "x.png"}]},
        "bad_field": {**good, "images": [{"bytes": None, "path": None}]},
        "image_count_mismatch": {**good, "images": [_embedded(0), _embedded(1)]},
        "no_assistant_turn": {**good, "messages": [{"role": "user", "content": "<image>Hi"}]},
        "bad_role": {**good, "messages": [{"role": "robot", "content": "<image>Hi"},
                                          {"role": "assistant", "content": "Yes."}]},
    }
    parquet = tmp_path / "rows.parquet"  # pyarrow: datasets refuses to encode the bad values
    pq.write_table(pa.Table.from_pylist(list(rows.values()), schema=FEATURES.arrow_schema),
                   parquet)
    unknown_item = {"messages": [{"role": "user", "content": [{"type": "file", "file": "a"}]},
                                 {"role": "assistant", "content": "ok"}]}
    uri = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {
        "url": "data:image/png;base64,@@@"}}]}, {"role": "assistant", "content": "ok"}]}
    jsonl = _write_jsonl(tmp_path / "typed.jsonl", [unknown_item, uri, _typed(
        [0], [("user", [0, "What?"]), ("assistant", ["A person."])], lambda i: {
            "type": "image", "path": _photo(PHOTOS[i])})])
    result = run_preprocess(PreprocessConfig(inputs=[str(parquet), jsonl],
                                             out=str(tmp_path / "o"), workers=1))
    assert result.input_rows == len(rows) + 3 == result.accepted + result.rejected
    got = {(r["source"], r["row"]): r["reason"]
           for r in pq.read_table(tmp_path / "o" / "rejects.parquet").to_pylist()}
    want = {("rows", k): reason for k, reason in enumerate(rows) if reason != "accepted"}
    want.update({("typed", 0): "bad_field", ("typed", 1): "corrupt_image"})
    assert got == want
    assert result.accepted == 2


def test_a_source_that_accepts_nothing_says_what_its_rows_look_like(sources, tmp_path):
    messages = sources["messages"][0]
    with pytest.raises(NothingAccepted, match="this looks like the messages format; pass "
                                              "--format messages"):
        run_preprocess(PreprocessConfig(inputs=[messages], out=str(tmp_path / "a"), workers=1,
                                        format="llava"))
    # Renamed columns: the hint names the list of turns; the mapping then reads every row.
    renamed = [{"dialog": [{"speaker": m["role"], "text": m["content"]} for m in r["messages"]],
                "pictures": r["images"]} for r in (_messages(*c) for c in CONVERSATIONS)]
    path = _write_jsonl(tmp_path / "renamed.jsonl", renamed)
    proc = vlmshard("preprocess", path, "--out", str(tmp_path / "b"), check=False)
    assert proc.returncode != 0
    assert "error: source renamed: all 4 row(s) rejected as missing_field: rows have 'dialog', " \
           "'pictures', none of them 'conversations', 'messages' or 'texts'; name yours with " \
           "--columns messages=dialog" in proc.stderr.splitlines()[-1], proc.stderr
    result = run_preprocess(PreprocessConfig(
        inputs=[path], out=str(tmp_path / "c"), workers=1,
        columns=["messages=dialog", "images=pictures", "role=speaker", "content=text"]))
    assert (result.accepted, result.rejected) == (len(CONVERSATIONS), 0)
    # A mapping that names a column the rows lack: one line, before any work.
    proc = vlmshard("preprocess", path, "--out", str(tmp_path / "d"), "--columns",
                    "messages=dialogue", check=False)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode != 0 and len(lines) == 1 and "messages=dialogue" in lines[0]
    assert not glob.glob(str(tmp_path / "d" / "_work" / "parts" / "*"))


def test_a_dataset_dict_needs_its_split(sources, tmp_path):
    with pytest.raises(ConfigError, match="holds several splits: pass --split.*one of train, test"):
        _preprocess([sources["dataset_dict"][0]], tmp_path / "o")
    with pytest.raises(ConfigError, match="has no split 'valid'"):
        _preprocess([sources["dataset_dict"][0], "--split", "valid"], tmp_path / "o")
    result = _preprocess([sources["dataset_dict"][0], "--split", "test"], tmp_path / "t")
    assert result.accepted == 1


def test_turn_pairs_put_their_images_first(folders, tmp_path):
    """the_cauldron / FineVision rows (``texts`` of user/assistant pairs, images without
    placeholders) read as the content lists Idefics3/SmolVLM fine-tuning builds from them."""
    pairs = [{"user": "Compare the two.", "assistant": "Both are photos.", "source": "x"},
             {"user": "Which is older?", "assistant": "The first.", "source": "x"}]
    features = datasets.Features({
        "images": datasets.Sequence(datasets.Image()),
        "texts": [{k: datasets.Value("string") for k in ("user", "assistant", "source")}]})
    cauldron = tmp_path / "cauldron.parquet"
    datasets.Dataset.from_list([{"images": [_embedded(0), _embedded(1)], "texts": pairs}],
                               features=features).to_parquet(str(cauldron))
    image = {"type": "image"}
    typed = {"images": [_photo(PHOTOS[0]), _photo(PHOTOS[1])], "messages": [
        {"role": "user", "content": [image, image, {"type": "text", "text": pairs[0]["user"]}]},
        {"role": "assistant", "content": pairs[0]["assistant"]},
        {"role": "user", "content": pairs[1]["user"]},
        {"role": "assistant", "content": pairs[1]["assistant"]}]}
    stats = []
    for name, path in (("pairs", str(cauldron)),
                       ("typed", _write_jsonl(tmp_path / "typed.jsonl", [typed]))):
        result = run_preprocess(PreprocessConfig(inputs=[path], out=str(tmp_path / name),
                                                 model=folders["qwen2_vl"], workers=1,
                                                 keep_tokens=True))
        assert result.accepted == 1, result.rejected_by_reason
        stats.append(pq.read_table(tmp_path / name / "stats", columns=list(SAME)).to_pylist())
    assert stats[0] == stats[1]


def test_a_meta_file_sets_format_columns_and_split_per_source(sources, tmp_path):
    renamed = [{"dialog": [{"speaker": m["role"], "text": m["content"]} for m in r["messages"]],
                "pictures": r["images"]} for r in (_messages(*c) for c in CONVERSATIONS)]
    meta = {"renamed": {"annotation": _write_jsonl(tmp_path / "renamed.jsonl", renamed),
                        "columns": {"messages": "dialog", "images": "pictures",
                                    "role": "speaker", "content": "text"}},
            "hub_test": {"annotation": sources["dataset_dict"][0], "split": "test",
                         "format": "messages"}}
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    result = run_preprocess(PreprocessConfig(inputs=[str(tmp_path / "meta.json")],
                                             out=str(tmp_path / "o"), workers=1))
    report = json.loads((tmp_path / "o" / "preprocess.json").read_text())
    assert {n: s["accepted"] for n, s in report["sources"].items()} == {
        "renamed": len(CONVERSATIONS), "hub_test": 1}
    assert result.rejected == 0


def test_rows_of_a_table_that_merged_both_formats_read_by_their_values():
    """``datasets`` gives each turn every key of both formats, null where a row had none."""
    from vlmshard.preprocess.conversation import RowFormat, parse_conversation

    turns = [{"from": None, "value": None, "role": "user", "content": "<image>\nHi"},
             {"from": None, "value": None, "role": "assistant", "content": "Hello."}]
    conversation = parse_conversation({"conversations": turns, "images": ["a.png"]}, RowFormat())
    assert [t.role for t in conversation.turns] == ["user", "assistant"]
    assert conversation.turns[1].texts == ["Hello."] and conversation.images[0].path == "a.png"


def test_an_older_run_without_kept_tokens_is_refused_not_mistokenized(sources, tmp_path):
    from vlmshard.shards.writer import WriteError

    pre, plan = str(tmp_path / "pre"), str(tmp_path / "plan")
    _preprocess(sources["parquet_embedded"], pre)
    run_pack(PackConfig(stats=pre, dp=1, micro_batches=1, out=plan))
    recorded = json.loads((tmp_path / "pre" / "preprocess.json").read_text())
    del recorded["config"]["text_encoding"]  # as an older vlmshard wrote it
    (tmp_path / "pre" / "preprocess.json").write_text(json.dumps(recorded))
    with pytest.raises(WriteError, match="older vlmshard.*preprocess again"):
        run_write(WriteConfig(plan=plan, stats=pre, out=str(tmp_path / "shards"), workers=1))


LLAMAFACTORY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "llamafactory")


def _same_samples(inputs: list[str], out, folder, datasets=()) -> list[dict]:
    result = run_preprocess(PreprocessConfig(inputs=inputs, out=str(out), model=folder, workers=1,
                                             keep_tokens=True, datasets=list(datasets)))
    assert result.rejected == 0, result.rejected_by_reason
    return pq.read_table(os.path.join(out, "stats"), columns=["source", *SAME]).to_pylist()


def test_llamafactory_dataset_info_is_read_as_llamafactory_reads_it(folders, tmp_path):
    """LLaMA-Factory's own entries, picked by name from its shipped dataset_info.json
    (tests/data/llamafactory): alpaca by default (instruction and input joined, output the
    answer), sharegpt with its columns and tags; each gives the samples of the same
    conversations written as messages rows by hand."""
    from PIL import Image

    data = tmp_path / "lf"
    shutil.copytree(LLAMAFACTORY, data)
    (data / "mllm_demo_data").mkdir()
    for name, photo in (("1.jpg", "rocket.jpg"), ("2.jpg", "chelsea.png")):
        Image.open(_photo(photo)).convert("RGB").save(data / "mllm_demo_data" / name)
    got = _same_samples([str(data / "dataset_info.json")], tmp_path / "lf-out",
                        folders["qwen2_vl"], datasets=["identity", "mllm_demo"])

    identity = json.loads((data / "identity.json").read_text())
    mllm = json.loads((data / "mllm_demo.json").read_text())
    by_hand = {
        "identity": [{"messages": [{"role": "user", "content": r["instruction"]},
                                   {"role": "assistant", "content": r["output"]}]}
                     for r in identity],
        "mllm_demo": [{"messages": r["messages"],
                       "images": [str(data / p) for p in r["images"]]} for r in mllm]}
    want = []
    for name, rows in by_hand.items():
        path = _write_jsonl(tmp_path / f"{name}.jsonl", rows)
        want += _same_samples([path], tmp_path / f"{name}-out", folders["qwen2_vl"])
    assert [r["source"] for r in got] == [r["source"] for r in want] == \
        ["identity"] * len(identity) + ["mllm_demo"] * len(mllm)
    assert got == want


def test_dataset_info_entries_are_picked_by_name(tmp_path):
    """LLaMA-Factory's shipped dataset_info.json (104 entries, most on a hub): without
    --datasets it is refused whole, the entries it cannot read listed by kind; named, an entry
    it cannot read is refused in one line naming it and why; a name it lacks is an error; the
    named readable entries are read, in the order named."""
    data = tmp_path / "lf"
    shutil.copytree(LLAMAFACTORY, data)
    info = str(data / "dataset_info.json")
    with pytest.raises(ConfigError, match=r"dataset_info.json: \d+ of 104 entries cannot be "
                                          r"read: .*--datasets") as refused:
        _preprocess([info], tmp_path / "all")
    assert "90 on a hub (alpaca_en, " in str(refused.value)
    assert "3 preference data (dpo_en_demo, dpo_zh_demo, kto_en_demo)" in str(refused.value)
    for name, why in (("alpaca_en", "loaded from hf_hub_url"), ("dpo_en_demo", "ranking"),
                      ("kto_en_demo", "KTO"), ("alpaca_en_demo", "not found")):
        with pytest.raises(ConfigError, match=rf"dataset_info.json: entry '{name}'.*{why}"):
            _preprocess([info], tmp_path / name, datasets=["identity", name])
    with pytest.raises(ConfigError, match="--datasets idnetity: no such entry"):
        _preprocess([info], tmp_path / "typo", datasets=["idnetity"])
    result = _preprocess([info], tmp_path / "picked", datasets=["identity,mllm_audio_demo"])
    rows = {"identity": 3, "mllm_audio_demo": 3}
    assert (result.input_rows, result.accepted) == (sum(rows.values()), rows["identity"])
    assert result.rejected_by_reason == {"unsupported_audio": rows["mllm_audio_demo"]}
    sources = pq.read_table(tmp_path / "picked" / "stats", columns=["source"])["source"]
    assert sources.to_pylist() == ["identity"] * rows["identity"]


def test_audio_is_rejected_never_dropped(tmp_path):
    """A row with audio, however it says so (a column, LLaMA-Factory's <audio> placeholder, a
    typed item), is an unsupported_audio reject; a source of only such rows beside accepted
    ones is a warning, not a failed job."""
    text = {"role": "assistant", "content": "Glass breaking."}
    rows = [{"messages": [{"role": "user", "content": "What is that?"}, text],
             "audios": ["1.mp3"]},
            {"messages": [{"role": "user", "content": "<audio>What is that?"}, text]},
            {"messages": [{"role": "user", "content": [
                {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}},
                {"type": "text", "text": "What is that?"}]}, text]},
            {"messages": [{"role": "user", "content": "What is that?"}, text]}]
    path = _write_jsonl(tmp_path / "audio.jsonl", rows)
    result = _preprocess([path], tmp_path / "out")
    assert (result.accepted, result.rejected_by_reason) == (1, {"unsupported_audio": 3})
    messages = pq.read_table(tmp_path / "out" / "rejects.parquet")["message"].to_pylist()
    assert ["'audios' column" in messages[0], "<audio> placeholder" in messages[1],
            "'input_audio'" in messages[2]] == [True] * 3


def _as_llamafactory_maps(row: dict) -> tuple[list[dict], list[dict]]:
    """(messages, tools) of a glaive row, as LLaMA-Factory's converter and Qwen tool formatter
    map them: function_call turns are assistant tool calls, observation turns tool results,
    a bare function definition is wrapped as a function tool."""
    roles = {"human": "user", "gpt": "assistant", "observation": "tool"}
    messages = []
    for turn in row["conversations"]:
        if turn["from"] == "function_call":
            call = json.loads(turn["value"])
            messages.append({"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": call}]})
        else:
            messages.append({"role": roles[turn["from"]], "content": turn["value"]})
    tools = [{"type": "function", "function": t} for t in json.loads(row["tools"] or "[]")]
    return messages, tools


def test_tool_calls_render_as_the_template_renders_them(folders, tmp_path):
    """LLaMA-Factory's glaive rows (tests/data/llamafactory) through its dataset_info.json entry:
    with Qwen3-VL's published template (tools rendered), every row is accepted, its ids are
    apply_chat_template's on the messages LLaMA-Factory maps it to, and what is supervised is
    each assistant turn as the model writes it after the generation prompt, tool calls whole.
    With a template that renders no tools (Qwen2-VL's), a row with tools or calls is a
    template_error, never a bad_role or a call dropped."""
    from transformers import AutoTokenizer

    data = tmp_path / "lf"
    shutil.copytree(LLAMAFACTORY, data)
    rows = json.loads((data / "glaive_toolcall_en_demo.json").read_text())
    info = str(data / "dataset_info.json")
    result = _preprocess([info], tmp_path / "q3", datasets=["glaive_toolcall_en_demo"],
                         model=folders["qwen3_vl"], keep_tokens=True)
    assert (result.accepted, result.rejected) == (len(rows), 0)
    samples = pq.read_table(tmp_path / "q3" / "stats").to_pylist()
    tok = AutoTokenizer.from_pretrained(folders["qwen3_vl"], local_files_only=True)
    calls = 0
    for row, sample in zip(rows, samples):
        messages, tools = _as_llamafactory_maps(row)
        want = tok.apply_chat_template(messages, tools=tools or None, tokenize=True,
                                       return_dict=False)
        assert sample["input_ids"] == list(want)
        replies = []  # each assistant turn: what follows its generation prompt, up to <|im_end|>
        for i, m in enumerate(messages):
            if m["role"] == "assistant":
                before = tok.apply_chat_template(messages[:i], tools=tools or None,
                                                 tokenize=False, add_generation_prompt=True)
                upto = tok.apply_chat_template(messages[:i + 1], tools=tools or None,
                                               tokenize=False)
                assert upto.startswith(before)
                replies.append(upto[len(before):].rstrip("\n"))
                calls += "tool_calls" in m
        supervised, run = [], []
        for token, label in zip(sample["input_ids"], sample["labels"]):
            if label != -100:
                run.append(token)
            elif run:
                supervised.append(tok.decode(run))
                run = []
        assert supervised + ([tok.decode(run)] if run else []) == replies
    assert calls >= 5 and any(r.startswith("<tool_call>") for r in replies)

    plain = _preprocess([info], tmp_path / "q2", datasets=["glaive_toolcall_en_demo"],
                        model=folders["qwen2_vl"])
    with_tools = sum(bool(json.loads(r["tools"])) for r in rows)
    assert plain.rejected_by_reason == {"template_error": with_tools}
    messages = pq.read_table(tmp_path / "q2" / "rejects.parquet")["message"].to_pylist()
    assert any("does not render an assistant's tool calls" in m or "takes none" in m
               for m in messages)


@pytest.mark.parametrize("how", ["column", "renamed", "dataset_info"])
def test_a_rows_system_prompt_is_the_one_rendered(folders, tmp_path, how):
    """A row's ``system`` (LLaMA-Factory's sharegpt column), renamed by ``--columns`` or by a
    dataset_info.json entry, renders as the template renders that system message."""
    from transformers import AutoTokenizer

    folder = folders["qwen2_vl"]
    turns = [("user", "Who are you?"), ("assistant", "A pirate cat, arr.")]
    key = "system" if how == "column" else "persona"
    row = {key: "You are a pirate cat.",
           "conversations": [{"from": ROLE_FROM[r], "value": t} for r, t in turns]}
    path = _write_jsonl(tmp_path / "pirate.jsonl", [row])
    columns = ["system=persona"] if how == "renamed" else []
    inputs = [path]
    if how == "dataset_info":
        inputs = [str(tmp_path / "dataset_info.json")]
        (tmp_path / "dataset_info.json").write_text(json.dumps({"pirate": {
            "file_name": "pirate.jsonl", "formatting": "sharegpt",
            "columns": {"messages": "conversations", "system": "persona"}}}))
    run_preprocess(PreprocessConfig(inputs=inputs, out=str(tmp_path / "o"), model=folder,
                                    workers=1, keep_tokens=True, columns=columns))
    (sample,) = pq.read_table(tmp_path / "o" / "stats").to_pylist()
    tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    rendered = tok.apply_chat_template(
        [{"role": "system", "content": "You are a pirate cat."},
         *({"role": r, "content": t} for r, t in turns)], tokenize=False)
    assert "You are a pirate cat." in rendered
    assert tok.decode(sample["input_ids"]) == rendered


def test_a_reader_registered_outside_the_package_reads_its_kind(tmp_path):
    """A user's container kind (tests/tsv_reader.py), named in VLMSHARD_READERS, is read in
    every worker process and gives the samples of the same rows as JSONL; without it the
    input's format is unknown, and registering a kind twice is an error."""
    from vlmshard.preprocess.containers import SourceOptions
    from vlmshard.preprocess.registry import register, sources_of
    from vlmshard.preprocess.readers import Jsonl

    pairs = [("What is 2+2?", "4."), ("Name a red fruit.", "A cherry."), ("Hi", "Hello!")]
    tsv = tmp_path / "qa.tsv"
    tsv.write_text("".join(f"{q}\t{a}\n" for q, a in pairs))
    jsonl = _write_jsonl(tmp_path / "qa.jsonl", [
        {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
        for q, a in pairs])
    env = {**os.environ, "VLMSHARD_READERS": "tsv_reader",
           "PYTHONPATH": os.pathsep.join(filter(None, [os.path.dirname(__file__),
                                                       os.environ.get("PYTHONPATH")]))}
    for path, out in ((str(tsv), "tsv"), (jsonl, "jsonl")):
        vlmshard("preprocess", path, "--out", str(tmp_path / out), "--workers", "2",
                 "--part-size", "1", "--keep-tokens", env=env)
    stats = [pq.read_table(tmp_path / out / "stats", columns=list(SAME)).to_pylist()
             for out in ("tsv", "jsonl")]
    assert len(stats[0]) == len(pairs) and stats[0] == stats[1]

    plain = vlmshard("preprocess", str(tsv), "--out", str(tmp_path / "plain"), check=False)
    assert plain.returncode != 0 and f"cannot tell the format of {tsv}" in plain.stderr
    with pytest.raises(ConfigError, match="'jsonl' is registered already"):
        register(Jsonl())
    assert sources_of(jsonl, SourceOptions(None, None))[0].kind == "jsonl"


def test_alpaca_rows_read_as_llamafactory_converts_them():
    """LLaMA-Factory's AlpacaDatasetConverter: history pairs first, then instruction and input
    (the non-empty ones) joined by a line break, the output the answer, the system column."""
    from vlmshard.preprocess.conversation import RowFormat, parse_conversation

    row = {"q": "Translate.", "input": "chat", "a": "cat", "sys": "Be terse.",
           "turns": [["Hi", "Hello."], ["Ready?", "Yes."]]}
    fmt = RowFormat.from_options("alpaca", {"prompt": "q", "response": "a", "history": "turns",
                                            "system": "sys"})
    got = [(t.role, t.texts) for t in parse_conversation(row, fmt).turns]
    assert got == [("system", ["Be terse."]), ("user", ["Hi"]), ("assistant", ["Hello."]),
                   ("user", ["Ready?"]), ("assistant", ["Yes."]),
                   ("user", ["Translate.\nchat"]), ("assistant", ["cat"])]
    plain = parse_conversation({"instruction": "", "input": "Only input", "output": "ok"},
                               RowFormat("alpaca"))
    assert [(t.role, t.texts) for t in plain.turns] == [("user", ["Only input"]),
                                                        ("assistant", ["ok"])]


TOOLS = [{"name": "get_weather", "description": "The weather of a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                         "required": ["city"]}}]


def test_a_rows_tools_go_to_a_template_that_takes_them(folders, tmp_path):
    """LLaMA-Factory's ``tools`` (a JSON string of bare function definitions) renders as
    ``apply_chat_template(tools=...)`` renders them wrapped as LLaMA-Factory's tool formatters
    wrap them; a template that takes no tools rejects the row rather than drop them."""
    from transformers import AutoTokenizer

    takes = str(tmp_path / "takes-tools")
    shutil.copytree(folders["qwen2_vl"], takes)
    template = os.path.join(takes, "chat_template.jinja")  # as transformers 5 saves it
    with open(template, encoding="utf-8") as f:
        text = f.read()
    with open(template, "w", encoding="utf-8") as f:
        f.write("{%- if tools %}<|im_start|>system\n# Tools\n{%- for tool in tools %}\n"
                "{{ tool | tojson }}{%- endfor %}<|im_end|>\n{% endif %}" + text)
    turns = [{"role": "user", "content": "Weather in Paris?"},
             {"role": "assistant", "content": "Sunny."}]
    path = _write_jsonl(tmp_path / "tools.jsonl", [{"messages": turns, "tools": json.dumps(TOOLS)},
                                                   {"messages": turns}])
    results = {name: run_preprocess(PreprocessConfig(inputs=[path], out=str(tmp_path / name),
                                                     model=folder, workers=1, keep_tokens=True))
               for name, folder in (("takes", takes), ("ignores", folders["qwen2_vl"]))}
    sample = pq.read_table(tmp_path / "takes" / "stats").to_pylist()[0]
    assert sample["row"] == 0
    tok = AutoTokenizer.from_pretrained(takes, local_files_only=True)
    rendered = tok.apply_chat_template(turns, tokenize=False, tools=[
        {"type": "function", "function": t} for t in TOOLS])
    assert '"name": "get_weather"' in rendered
    assert tok.decode(sample["input_ids"]) == rendered
    assert results["ignores"].rejected_by_reason == {"template_error": 1}
    (reject,) = pq.read_table(tmp_path / "ignores" / "rejects.parquet").to_pylist()
    assert "1 tool(s) and the chat template takes none" in reject["message"]


def test_cutoff_len_cuts_as_llamafactory_and_never_an_image(folders, tmp_path):
    """--cutoff-len: a one-turn sample over N tokens keeps the beginning of its prompt and of its
    answer, split as LLaMA-Factory's infer_seqlen splits N (a short answer whole, else a short
    prompt whole, else both in proportion); its image's tokens stay whole; a sample whose image
    alone exceeds N is a too_long reject; the writer's re-tokenizing cuts alike."""
    from PIL import Image
    from transformers import AutoTokenizer

    from vlmshard.preprocess.retokenize import RecordedPreprocess, Retokenizer, SourceRows

    photo = str(tmp_path / "cat.png")
    Image.new("RGB", (56, 56), (200, 120, 40)).save(photo)
    long_q, long_a = "tell me " * 60, "the cat sat " * 50
    rows = [{"messages": [{"role": "user", "content": "<image>" + long_q},
                          {"role": "assistant", "content": "A cat."}], "images": [photo]},
            {"messages": [{"role": "user", "content": "Hi"},
                          {"role": "assistant", "content": long_a}]},
            {"messages": [{"role": "user", "content": "<image>" + long_q},
                          {"role": "assistant", "content": long_a}], "images": [photo]},
            {"messages": [{"role": "user", "content": "<image>Hi"},
                          {"role": "assistant", "content": "A cat."}], "images": [photo]}]
    path = _write_jsonl(tmp_path / "long.jsonl", rows)
    full = _preprocess([path], tmp_path / "full", model=folders["qwen2_vl"], keep_tokens=True)
    assert full.rejected == 0
    whole = pq.read_table(tmp_path / "full" / "stats").to_pylist()
    pad = AutoTokenizer.from_pretrained(folders["qwen2_vl"]).convert_tokens_to_ids("<|image_pad|>")
    image_tokens = whole[3]["input_ids"].count(pad)
    assert image_tokens > 0
    cutoff = 120
    cut = _preprocess([path], tmp_path / "cut", model=folders["qwen2_vl"], keep_tokens=True,
                      cutoff_len=cutoff)
    assert cut.rejected == 0
    samples = pq.read_table(tmp_path / "cut" / "stats").to_pylist()
    for before, after in zip(whole, samples):
        ids, labels = before["input_ids"], before["labels"]
        answer = [k for k, label in enumerate(labels) if label != -100]
        prompt, target = answer[0], answer[-1] + 1 - answer[0]  # one turn: prompt, answer, "\n"
        assert answer == list(range(answer[0], answer[-1] + 1))
        if len(ids) <= cutoff:
            assert after["input_ids"] == ids
            continue
        # LLaMA-Factory's split, by hand: the numbers of each case
        if target * 2 < cutoff:
            want_target = target
        elif prompt * 2 < cutoff:
            want_target = cutoff - prompt
        else:
            want_target = int(cutoff * target / (prompt + target))
        want_prompt = min(cutoff - want_target, prompt)
        assert after["input_ids"] == ids[:want_prompt] + ids[prompt:prompt + want_target]
        assert after["seq_len"] == len(after["input_ids"]) <= cutoff
        assert after["loss_tokens"] == want_target
        assert after["input_ids"].count(pad) == ids.count(pad)  # the image whole
    assert [len(s["input_ids"]) < len(w["input_ids"]) for s, w in zip(samples, whole)] == \
        [True, True, True, False]

    recorded = RecordedPreprocess(json.loads((tmp_path / "cut" / "preprocess.json").read_text()))
    spec = recorded.sample_spec()
    records = SourceRows(spec.sources).records([(s["source"], s["row"]) for s in samples])
    again = Retokenizer(spec)
    assert [again.encode(s, records[(s["source"], s["row"])]) for s in samples] == \
        [(s["input_ids"], s["labels"]) for s in samples]

    small = image_tokens // 2
    tight = _preprocess([path], tmp_path / "tight", model=folders["qwen2_vl"], cutoff_len=small)
    assert tight.rejected_by_reason == {"too_long": 3}
    assert "raise it" in pq.read_table(tmp_path / "tight" / "rejects.parquet")["message"][0].as_py()
