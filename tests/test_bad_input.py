"""Bad input: every kind of bad row becomes exactly one reject with its reason, or is accepted
with the image sizes and tiles the model sees; input rows = accepted + rejected; the job never
stops.

One data-driven test writes a JSONL file (and a broken JSON list) with one row per kind, each
row's ``id`` naming its expected outcome: a reject reason, or ``accepted-...``. The policies it
pins down:

- Images the model can read are accepted with their true size: WebP, TIFF, GIF, AVIF, CMYK JPEG,
  16-bit grey PNG (mode I;16), a PNG named .jpg. Their pixels are converted to RGB the way
  ``transformers`` converts (``tiling.to_rgb``), which for I;16 clips at 255 rather than scales.
- EXIF orientation: sizes and tiles are those of the pixels as stored, because that is what the
  loader decodes (``shards/records.py::decoded_images`` does not apply ``exif_transpose``); the
  test checks the recorded size and tiles against the loader's own decode of each accepted image.
- ``..`` leading out of the image root is a ``path_outside_root`` reject (``--allow-outside-image-
  root`` reads it). The check is on the path as written: a symlink inside the root is followed
  wherever it points (a Hugging Face cache links snapshots to blobs outside them), and absolute
  paths and URLs name their file themselves.
- A symlink loop, a dangling symlink, a folder or a FIFO where an image should be is a
  ``missing_image`` (never a hang on the FIFO).
- NUL characters in text or image paths are ``nul_in_text``: binary or UTF-16 data read as text.
- A row doomed by a cheap bound (10,000 images, a 10 MB turn) is ``too_long`` before any image is
  read or any text tokenized; more images than the stats table's int16 ``n_images`` holds is
  ``too_many_images`` even without ``--max-seq-len``.

Not covered here: ``unreachable_image`` (needs a URL; tests/test_faults.py) and ``template_error``
(needs a model folder's chat template; tests/test_families.py).
"""

from __future__ import annotations

import io
import json
import os
import time

import numpy as np
import pyarrow.parquet as pq
import pytest
from PIL import Image, features

from vlmshard.preprocess import PreprocessConfig, run_preprocess
from vlmshard.families import policy_from_dict
from vlmshard.preprocess.conversation import text_turn
from vlmshard.preprocess.sources import Source
from vlmshard.rejects import REASONS

# Pillow here reads and writes AVIF (Pillow >= 11.2 wheels bundle libavif); where it does not, the
# AVIF kinds are left out rather than expected to fail.
AVIF = features.check("avif")

# Reasons about one image: their messages must name the image's path.
IMAGE_REASONS = {"path_outside_root", "missing_image", "empty_image", "corrupt_image",
                 "truncated_image", "decompression_bomb", "bad_aspect_ratio"}

SOURCE = Source(name="s", kind="jsonl", path="/data/s.jsonl", image_root="/data")
OK = [{"from": "human", "value": "<image>\nDescribe the image."},
      {"from": "gpt", "value": "A picture."}]


def _conv(question: str, answer: str, n_images: int = 0) -> list[dict]:
    return [{"from": "human", "value": "<image>\n" * n_images + question},
            {"from": "gpt", "value": answer}]


def _encoded(image: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    image.save(buf, fmt, **kw)
    return buf.getvalue()


def _photo(width: int, height: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (height, width, 3), dtype=np.uint8))


def _bomb_png(width: int, height: int) -> bytes:
    """A valid PNG whose header claims ``width``×``height``."""
    import struct
    import zlib

    data = bytearray(_encoded(_photo(8, 8), "PNG"))
    data[16:24] = struct.pack(">II", width, height)
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])) & 0xFFFFFFFF)
    return bytes(data)


def _exif_jpeg(width: int, height: int, orientation: int) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = orientation
    return _encoded(_photo(width, height, seed=orientation), "JPEG", exif=exif.tobytes())


def _write_images(root: str) -> dict[str, tuple[int, int]]:
    """The image files under ``root/images`` (and one outside ``root``); returns the stored size
    of each readable one, by path relative to ``root``."""
    images = os.path.join(root, "images")
    os.makedirs(images)
    sizes: dict[str, tuple[int, int]] = {}

    def put(name: str, data: bytes, size: tuple[int, int] | None = None) -> None:
        with open(os.path.join(images, name), "wb") as f:
            f.write(data)
        if size:
            sizes[f"images/{name}"] = size

    photo = _photo(160, 96)
    jpeg, png = _encoded(photo, "JPEG", quality=90), _encoded(photo, "PNG")
    webp, tiff = _encoded(photo, "WEBP", quality=80), _encoded(photo, "TIFF")
    put("good.png", png, (160, 96))
    put("good.jpg", jpeg, (160, 96))
    put("photo.webp", webp, (160, 96))
    put("photo.tif", tiff, (160, 96))
    put("photo-lzw.tif", _encoded(photo, "TIFF", compression="tiff_lzw"), (160, 96))
    put("photo.gif", _encoded(photo.convert("P", palette=Image.Palette.ADAPTIVE), "GIF"),
        (160, 96))
    frames = [_photo(120, 80, seed=k) for k in range(3)]
    put("animated.gif", _encoded(frames[0], "GIF", save_all=True, append_images=frames[1:]),
        (120, 80))
    put("cmyk.jpg", _encoded(photo.convert("CMYK"), "JPEG"), (160, 96))
    grey16 = Image.fromarray(np.arange(96 * 160, dtype=np.uint16).reshape(96, 160) * 4)
    assert grey16.mode == "I;16"
    put("grey16.png", _encoded(grey16, "PNG"), (160, 96))
    put("png-named.jpg", png, (160, 96))
    put("motion-photo.jpg", jpeg + b"\x00\x00\x00\x18ftypmp42" + bytes(2048), (160, 96))
    # Stored 300x100 with orientation 6 (or 8): a viewer shows it upright as 100x300.
    put("exif6.jpg", _exif_jpeg(300, 100, 6), (300, 100))
    put("exif8.jpg", _exif_jpeg(300, 100, 8), (300, 100))
    put("banner.png", _encoded(_photo(1800, 8), "PNG"), (1800, 8))  # 225:1
    if AVIF:
        avif = _encoded(photo, "AVIF")
        put("photo.avif", avif, (160, 96))
        put("truncated.avif", avif[: len(avif) * 2 // 3])

    put("empty.jpg", b"")
    put("corrupt.jpg", b"this is text that pretends to be an image\n" * 8)
    put("svg.png", b'<svg xmlns="http://www.w3.org/2000/svg" width="10" height="10"/>\n')
    put("truncated.jpg", jpeg[: len(jpeg) // 2])
    put("truncated.png", png[: len(png) // 2])
    put("truncated.webp", webp[: len(webp) * 2 // 3])
    put("truncated.tif", tiff[: len(tiff) * 2 // 3])
    put("truncated.gif", _encoded(photo, "GIF")[:-400])
    put("bomb.png", _bomb_png(30000, 30000))

    loop = os.path.join(images, "loop")
    os.makedirs(loop)
    os.symlink("b.png", os.path.join(loop, "a.png"))
    os.symlink("a.png", os.path.join(loop, "b.png"))
    os.symlink("gone.png", os.path.join(images, "dangling.png"))
    os.makedirs(os.path.join(images, "folder.png"))
    os.mkfifo(os.path.join(images, "fifo.png"))
    # A readable image outside the root: '..' must not reach it; a symlink in the root may.
    with open(os.path.join(os.path.dirname(root), "outside.png"), "wb") as f:
        f.write(png)
    os.symlink(os.path.join(os.path.dirname(root), "outside.png"),
               os.path.join(images, "linked-out.png"))
    sizes["images/linked-out.png"] = (160, 96)
    return sizes


def _rows(root: str, tiling: str) -> list[tuple[str, bytes]]:
    """(expected outcome, JSONL line) per kind."""

    def row(outcome: str, **fields) -> tuple[str, bytes]:
        return outcome, json.dumps({"id": outcome, **fields}).encode("utf-8")

    def image_row(outcome: str, path: str, **fields) -> tuple[str, bytes]:
        return row(outcome, image=path, conversations=OK, **fields)

    utf16 = json.dumps({"id": "undecodable_text", "conversations": OK}).encode("utf-16-le")
    rows = [
        # Present reasons.
        image_row("accepted-png", "images/good.png"),
        row("accepted-text-only", conversations=_conv("Say hi.", "Hi.")),
        ("malformed_json", b'{"id": "malformed_json", "conversations": ['),
        ("malformed_json", b'["malformed_json", "a JSON array, not an object"]'),
        ("malformed_json", b'{"id": "malformed_json", "conversations": "raw NUL \x00 byte"}'),
        ("undecodable_text", (b'{"id": "undecodable_text", "conversations": '
                              b'[{"from": "human", "value": "Latin-1: caf\xe9"}]}')),
        ("undecodable_text", b"\xff\xfe" + utf16),  # a UTF-16 line (with its BOM)
        ("undecodable_text", (b'{"id": "undecodable_text", "conversations": [{"from": "human", '
                              b'"value": "lone \\ud800 surrogate"}, '
                              b'{"from": "gpt", "value": "x"}]}')),
        row("missing_field", image="images/good.png"),
        row("missing_field", conversations=[{"from": "human"}, {"from": "gpt", "value": "x"}]),
        row("bad_field", image=42, conversations=OK),
        row("bad_field", image="", conversations=OK),
        row("bad_field", conversations="human: hi\ngpt: hello"),
        row("bad_field", conversations=[{"from": "human", "value": ["not", "text"]},
                                        {"from": "gpt", "value": "x"}]),
        row("bad_role", conversations=[{"from": "robot", "value": "beep"},
                                       {"from": "gpt", "value": "boop"}]),
        # A 1 MB role: the message stays short.
        row("bad_role", conversations=[{"from": "r" * 1_000_000, "value": "beep"},
                                       {"from": "gpt", "value": "boop"}]),
        row("no_assistant_turn", conversations=[{"from": "human", "value": "hi"}]),
        row("no_assistant_turn", conversations=_conv("Say nothing.", " \n ")),
        row("image_count_mismatch", image="images/good.png",
            conversations=_conv("Compare.", "Same.", 2)),
        image_row("path_outside_root", "../outside.png"),
        image_row("path_outside_root", "images/../../outside.png"),
        image_row("missing_image", "images/does-not-exist.jpg"),
        image_row("missing_image", "images/loop/a.png"),  # a -> b -> a
        image_row("missing_image", "images/dangling.png"),
        image_row("missing_image", "images/folder.png"),
        image_row("missing_image", "images/fifo.png"),  # open() would block forever
        image_row("empty_image", "images/empty.jpg"),
        image_row("corrupt_image", "images/corrupt.jpg"),
        image_row("corrupt_image", "images/svg.png"),
        image_row("truncated_image", "images/truncated.jpg"),
        image_row("truncated_image", "images/truncated.png"),
        image_row("truncated_image", "images/truncated.webp"),
        image_row("truncated_image", "images/truncated.tif"),
        image_row("truncated_image", "images/truncated.gif"),
        image_row("decompression_bomb", "images/bomb.png"),
        row("too_long", conversations=_conv("Write a lot.", "word " * 9000)),
        # New kinds.
        row("nul_in_text", conversations=_conv("NUL \u0000 inside", "x")),
        # UTF-16 text that a tool decoded as Latin-1 and re-encoded: a NUL after every letter.
        row("nul_in_text", conversations=_conv("hello".encode("utf-16-le").decode("latin-1"), "x")),
        image_row("nul_in_text", "images/good\u0000.png"),
        row("too_long", conversations=_conv("Summarize.", "word " * 2_000_000)),  # one 10 MB turn
        row("too_long", image=["images/good.png"] * 10_000,  # 10,000 images in one row
            conversations=_conv("Compare them all.", "Done.", 10_000)),
        image_row("accepted-webp", "images/photo.webp"),
        image_row("accepted-tiff", "images/photo.tif"),
        image_row("accepted-tiff-lzw", "images/photo-lzw.tif"),
        image_row("accepted-gif", "images/photo.gif"),
        image_row("accepted-animated-gif", "images/animated.gif"),
        image_row("accepted-cmyk-jpeg", "images/cmyk.jpg"),
        image_row("accepted-16-bit-png", "images/grey16.png"),
        image_row("accepted-png-named-jpg", "images/png-named.jpg"),
        image_row("accepted-jpeg-with-data-after-eoi", "images/motion-photo.jpg"),
        image_row("accepted-exif-orientation-6", "images/exif6.jpg"),
        image_row("accepted-exif-orientation-8", "images/exif8.jpg"),
        image_row("accepted-symlink-out-of-root", "images/linked-out.png"),
        image_row("accepted-absolute-path", os.path.join(root, "images", "good.jpg")),
        # Qwen2-VL's processor refuses an aspect ratio over 200:1; InternVL tiles it.
        image_row("bad_aspect_ratio" if tiling == "qwen2vl" else "accepted-225-to-1",
                  "images/banner.png"),
    ]
    if AVIF:
        rows += [image_row("accepted-avif", "images/photo.avif"),
                 image_row("truncated_image", "images/truncated.avif")]
    return rows


def _image_path(line: bytes) -> str | None:
    try:
        image = json.loads(line).get("image")
    except (ValueError, AttributeError):
        return None
    return image if isinstance(image, str) and image else None


def _loader_view(path: str, tiles: int, policy) -> tuple[int, int]:
    """The size the training loader decodes ``path`` to, checked against the planned tiles by
    the loader's own code (``RecordError`` if they disagree)."""
    from vlmshard.shards.records import Record, decoded_images

    with open(path, "rb") as f:
        data = f.read()
    record = Record(shard="test", key="000000000_000", step=0, rank=0, micro=0,
                    samples=[{"sample_id": 0, "source": "rows", "images": ["000.img"],
                              "image_tiles": [tiles]}],
                    input_ids=np.zeros(0, np.int32), labels=np.zeros(0, np.int32),
                    images=[data], cu_seqlens=[0])
    (decoded,) = decoded_images(record, {"rows": policy})
    assert decoded.pixels().shape[0] == tiles * policy.rows_per_tile
    return decoded.width, decoded.height


@pytest.mark.parametrize("tiling", ["internvl", "qwen2vl"])
def test_every_kind_of_bad_input_gets_its_reason(tmp_path, tiling):
    root = str(tmp_path / "data")
    os.makedirs(root)
    sizes = _write_images(root)
    rows = _rows(root, tiling)
    kinds = len(rows)
    assert kinds >= 50
    rows_path = os.path.join(root, "rows.jsonl")
    with open(rows_path, "wb") as f:
        f.write(b"\n".join(line for _, line in rows) + b"\n")
    broken_path = os.path.join(root, "broken.json")  # a JSON list file that does not parse
    with open(broken_path, "w") as f:
        f.write('[{"id": "unreadable_source", "conversations": []},')
    out = tmp_path / "out"

    start = time.monotonic()
    result = run_preprocess(PreprocessConfig(inputs=[rows_path, broken_path], out=str(out),
                                             max_seq_len=8192, workers=1, tiling=tiling))
    seconds = time.monotonic() - start

    report = json.loads((out / "preprocess.json").read_text())
    rejects = pq.read_table(out / "rejects.parquet").to_pylist()
    stats = pq.read_table(out / "stats").to_pylist()
    # input = accepted + rejected, per source and in total.
    assert result.input_rows == len(rows) + 1 == result.accepted + result.rejected
    assert report["totals"]["input_rows"] == report["totals"]["accepted"] + \
        report["totals"]["rejected"] == len(rows) + 1
    assert (len(stats), len(rejects)) == (result.accepted, result.rejected)
    # Every row gets exactly its expected outcome, once.
    got = {}
    for r in rejects:
        assert (r["source"], r["row"]) not in got, r
        got[(r["source"], r["row"])] = r["reason"]
    for s in stats:
        assert (s["source"], s["row"]) not in got, s
        got[(s["source"], s["row"])] = "accepted"
    want = {("rows", k): outcome.split("-")[0] for k, (outcome, _) in enumerate(rows)}
    want[("broken", 0)] = "unreadable_source"
    assert got == want
    for name, src in report["sources"].items():
        assert src["input_rows"] == src["accepted"] + src["rejected"], name
        assert sum(src["by_reason"].values()) == src["rejected"], name
    assert set(report["rejected_by_reason"]) <= set(REASONS)
    # Messages: one line each, short, naming the image where the reason is about one.
    for r in rejects:
        message = r["message"]
        assert message and "\n" not in message and len(message) <= 1000, r
        if r["source"] == "rows" and r["reason"] in IMAGE_REASONS:
            path = _image_path(rows[r["row"]][1])
            assert os.path.basename(path) in message, r
    # Accepted images: their stored size, the policy's tiles, and the loader agrees on both.
    policy = policy_from_dict(report["config"]["tiling"])
    for s in stats:
        path = _image_path(rows[s["row"]][1])
        if path is None:
            continue
        key = os.path.relpath(path, root) if os.path.isabs(path) else path
        w, h = sizes[key]
        assert s["image_sizes"] == [{"w": w, "h": h}], rows[s["row"]][0]
        assert s["image_tiles"] == [policy.tiles(w, h, 1)], rows[s["row"]][0]
        assert _loader_view(s["image_paths"][0], s["image_tiles"][0], policy) == (w, h)
    # The 10 MB turn and the 10,000-image row are rejected by cheap bounds: the whole job,
    # ~60 rows, stays fast.
    assert seconds < 30, seconds


def test_exif_orientation_tiles_follow_the_pixels_the_loader_decodes(tmp_path):
    """All eight EXIF orientations of a non-square JPEG: the header's size and tile count are
    those of the stored pixels, and the loader decodes exactly that (no transpose), under both
    policies. Stated: the model sees the image as stored, as transformers' processors do when
    handed the decoded PIL image (its ``load_image`` of a path would turn it upright)."""
    from vlmshard.preprocess.images import read_image_header
    from vlmshard.families.internvl import InternVLTiling
    from vlmshard.families.qwen2vl import Qwen2VLTiling

    for orientation in range(1, 9):
        path = str(tmp_path / f"o{orientation}.jpg")
        with open(path, "wb") as f:
            f.write(_exif_jpeg(900, 300, orientation))
        header = read_image_header(path)
        assert (header.width, header.height) == (900, 300)
        for policy in (InternVLTiling(), Qwen2VLTiling()):
            tiles = policy.tiles(header.width, header.height, 1)
            assert _loader_view(path, tiles, policy) == (900, 300)
    # The orientation matters to the count: upright (300x900) InternVL would cut 1x3 + thumbnail.
    assert InternVLTiling().grid(900, 300, 1) != InternVLTiling().grid(300, 900, 1)


def test_doomed_rows_are_rejected_before_any_image_is_read_or_text_tokenized(monkeypatch):
    from vlmshard.preprocess import sample
    from vlmshard.families.internvl import InternVLTiling
    from vlmshard.families.qwen2vl import Qwen2VLTiling
    from vlmshard.preprocess.tokenize import TekkenEncoder, tekken_tokenizer
    from vlmshard.rejects import Reject

    def no_read(*args, **kwargs):
        raise AssertionError("an image header was read")

    encoder = TekkenEncoder(tekken_tokenizer())

    def no_tokenize(*args, **kwargs):
        raise AssertionError("the text was tokenized")

    monkeypatch.setattr(sample, "read_image_header", no_read)
    monkeypatch.setattr(encoder, "encode", no_tokenize)
    many = {"image": [f"images/{k}.png" for k in range(10_000)],  # none exists
            "conversations": _conv("Compare.", "Done.", 10_000)}
    huge = {"image": "images/good.png",
            "conversations": _conv("Summarize.", "x" * 10_000_000, 1)}
    limits = sample.SampleLimits(max_seq_len=8192)
    for tiling in (InternVLTiling(), Qwen2VLTiling()):
        for record in (many, huge):
            # CPU time, not wall time: a loaded CI machine stretched 0.2 s of it to 2.3 s
            start = time.process_time()
            with pytest.raises(Reject) as e:
                sample.process_record(record, SOURCE, tiling, encoder, limits, False)
            assert e.value.reason == "too_long", e.value
            assert "at least" in e.value.message and "8192" in e.value.message
            assert time.process_time() - start < 2
    # Without --max-seq-len, more images than the stats table's int16 n_images can hold.
    too_many = {"image": ["a.png"] * 40_000, "conversations": _conv("Look.", "Ok.", 40_000)}
    with pytest.raises(Reject) as e:
        sample.process_record(too_many, SOURCE, InternVLTiling(), encoder,
                              sample.SampleLimits(), False)
    assert e.value.reason == "too_many_images"


def test_a_row_with_too_many_images_does_not_stop_the_job(tmp_path):
    """40,000 images and no --max-seq-len: before, the int16 n_images column overflowed when the
    part was written and the whole job failed."""
    Image.new("RGB", (8, 8)).save(tmp_path / "a.png")
    rows = [{"image": ["a.png"] * 40_000, "conversations": _conv("Look.", "Ok.", 40_000)},
            {"image": "a.png", "conversations": OK}]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = run_preprocess(PreprocessConfig(inputs=[str(path)], out=str(tmp_path / "out"),
                                             workers=1))
    assert (result.accepted, result.rejected_by_reason) == (1, {"too_many_images": 1})


def test_reject_messages_are_one_bounded_line():
    from vlmshard.rejects import Reject

    r = Reject("missing_image", "image not found: images/a\nb\u2028c\x00.png " + "x" * 5000)
    assert len(r.message.splitlines()) == 1 and "\x00" not in r.message
    assert len(r.message) <= 1000 and r.message.startswith("image not found: images/a\\nb")


# Rows that the JSONL reader itself must tell apart.

def _run_lines(tmp_path, lines: list[bytes]):
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    run_preprocess(PreprocessConfig(inputs=[str(path)], out=str(tmp_path / "out"), workers=1))
    return {r["row"]: r["reason"] for r in pq.read_table(tmp_path / "out/rejects.parquet")
            .to_pylist()}


def test_deeply_nested_json_is_a_reject_not_a_crash(tmp_path):
    good = json.dumps({"conversations": _conv("Hi.", "Hello.")}).encode()
    assert _run_lines(tmp_path, [b"[" * 100_000, good]) == {0: "malformed_json"}


def test_a_utf8_bom_on_the_first_line_is_accepted(tmp_path):
    good = json.dumps({"conversations": _conv("Hi.", "Hello.")}).encode()
    assert _run_lines(tmp_path, [b"\xef\xbb\xbf" + good, good]) == {}


def test_a_utf16_line_without_bom_is_undecodable_text(tmp_path):
    good = json.dumps({"conversations": _conv("Hi.", "Hello.")}).encode()
    assert _run_lines(tmp_path, [good.decode().encode("utf-16-le"), good]) == {
        0: "undecodable_text"}


@pytest.fixture(scope="module")
def qwen_folder(tmp_path_factory) -> str:
    from vlmshard.families import tiny_folder

    return tiny_folder("qwen2_vl", str(tmp_path_factory.mktemp("models") / "qwen2vl"))


def test_a_model_tokenizer_bounds_a_10mb_turn_without_tokenizing_it(qwen_folder):
    """With a model folder's tokenizer too, a 10 MB turn is ``too_long`` at once (it takes ~10 s
    to tokenize), and the bound never exceeds the true count."""
    from vlmshard.preprocess import sample
    from vlmshard.families import load_model
    from vlmshard.preprocess.chat import ChatTemplateEncoder
    from vlmshard.rejects import Reject

    model, tiling = load_model(qwen_folder)
    encoder = ChatTemplateEncoder(model)
    texts = ["Hello there.", "e\u0301\u0301 composed " * 50, "漢字かな交じり文" * 40,
             "😀" * 300, "=" * 5000 + " " * 3000, "<|im_end|> stays text " * 30, "x" * 20000]
    for text in texts:
        turns = [text_turn("user", "<image>\n" + text), text_turn("assistant", text)]
        assert 0 < encoder.min_text_tokens(turns) <= encoder.encode(turns, [4], False).text_tokens
    huge = {"conversations": _conv("Summarize.", "word " * 2_000_000)}
    start = time.process_time()
    with pytest.raises(Reject) as e:
        sample.process_record(huge, SOURCE, tiling, encoder,
                              sample.SampleLimits(max_seq_len=8192), False)
    assert e.value.reason == "too_long" and "at least" in e.value.message
    assert time.process_time() - start < 3


def test_a_chat_template_that_refuses_a_conversation_is_template_error(qwen_folder, tmp_path):
    import shutil

    folder = str(tmp_path / "refusing")
    shutil.copytree(qwen_folder, folder)
    template_path = os.path.join(folder, "chat_template.jinja")
    with open(template_path) as f:
        template = f.read()
    with open(template_path, "w") as f:
        f.write("{% if messages[0]['role'] == 'system' %}"
                "{{ raise_exception('System role not supported') }}{% endif %}" + template)
    rows = [{"conversations": [{"from": "system", "value": "Be brief."}, *_conv("Hi.", "Hello.")]},
            {"conversations": _conv("Hi.", "Hello.")}]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = run_preprocess(PreprocessConfig(inputs=[str(path)], out=str(tmp_path / "out"),
                                             model=folder, workers=1))
    assert (result.accepted, result.rejected_by_reason) == (1, {"template_error": 1})
    (reject,) = pq.read_table(tmp_path / "out/rejects.parquet").to_pylist()
    assert "System role not supported" in reject["message"]


def test_a_bug_in_our_message_mapping_stops_the_job_with_its_exception(qwen_folder, tmp_path,
                                                                       monkeypatch):
    """Only the template's own rendering is caught as a data error: a bug in the project's
    mapping of turns to messages (a ZeroDivisionError injected into ``to_messages`` where it
    builds the messages with the text in place) surfaces as that exception, never as a
    ``template_error`` reject on every row."""
    from vlmshard.preprocess import chat

    real = chat.to_messages

    def buggy(turns, rules=chat.TextRules(), marked=True):
        if not marked:
            raise ZeroDivisionError("an injected bug")
        return real(turns, rules, marked)

    monkeypatch.setattr(chat, "to_messages", buggy)
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"conversations": _conv("Hi.", "Hello.")}) + "\n")
    with pytest.raises(ZeroDivisionError, match="an injected bug"):
        run_preprocess(PreprocessConfig(inputs=[str(path)], out=str(tmp_path / "out"),
                                        model=qwen_folder, workers=1))


def test_debug_shows_an_error_with_the_chain_of_its_causes(qwen_folder, tmp_path):
    """An error is one line; ``--debug`` prints its traceback first, with what caused it (here
    the JSON parser's error behind an unreadable config.json)."""
    import shutil

    from helpers import vlmshard

    folder = str(tmp_path / "broken")
    shutil.copytree(qwen_folder, folder)
    with open(os.path.join(folder, "config.json"), "w") as f:
        f.write("{not json")
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"conversations": _conv("Hi.", "Hello.")}) + "\n")
    args = ("preprocess", str(path), "--model", folder, "--workers", "1")
    plain = vlmshard(*args, "--out", str(tmp_path / "a"), check=False)
    debug = vlmshard("--debug", *args, "--out", str(tmp_path / "b"), check=False)
    assert plain.returncode == debug.returncode == 1
    assert plain.stderr.strip().splitlines()[-1].startswith("vlmshard preprocess: error: ")
    assert "Traceback" not in plain.stderr
    assert debug.stderr.strip().splitlines()[-1] == plain.stderr.strip().splitlines()[-1]
    assert "json.decoder.JSONDecodeError: Expecting property name" in debug.stderr
    assert "The above exception was the direct cause of the following exception" in debug.stderr


# Empty input: a job that reads no row accepts nothing, and that is an error.

@pytest.mark.parametrize("name,content", [("empty.jsonl", b""), ("list.json", b"[]\n"),
                                          ("blank.jsonl", b"\n  \n\n")])
def test_an_input_with_no_rows_fails_the_job_and_pack_says_why(tmp_path, name, content):
    from tests.helpers import vlmshard

    path = tmp_path / name
    path.write_bytes(content)
    out = tmp_path / "out"
    proc = vlmshard("preprocess", str(path), "--out", str(out), "--workers", "1", check=False)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.splitlines()[-1] == (
        f"vlmshard preprocess: error: no rows in {path}: the job accepted nothing")
    assert not (out / "preprocess.json").exists() and not (out / "_work").exists()
    # pack on that folder names the empty input, not rejected rows that do not exist
    proc = vlmshard("pack", "--stats", str(out), "--out", str(tmp_path / "plan"), "--dp", "1",
                    check=False)
    assert proc.returncode == 1
    assert proc.stderr.splitlines()[-1] == (
        f"vlmshard pack: error: {out} holds no samples: its preprocess read no rows (empty "
        f"inputs) and accepted nothing")
    assert not (tmp_path / "plan" / "plan.json").exists()


def test_an_empty_source_beside_good_ones_is_a_warning_naming_it(tmp_path, caplog):
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps({"conversations": _conv("Hi.", "Hello.")}) + "\n")
    (tmp_path / "empty.jsonl").write_bytes(b"")
    (tmp_path / "none.json").write_text("[]")
    inputs = [str(good), str(tmp_path / "empty.jsonl"), str(tmp_path / "none.json")]
    with caplog.at_level("WARNING", logger="vlmshard.preprocess.job"):
        result = run_preprocess(PreprocessConfig(inputs=inputs, out=str(tmp_path / "out"),
                                                 workers=1))
    assert (result.accepted, result.rejected) == (1, 0)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warnings == [
        f"source empty: no rows in {tmp_path}/empty.jsonl; it adds nothing to the job",
        f"source none: no rows in {tmp_path}/none.json; it adds nothing to the job"]


def test_rejects_parquet_is_the_same_bytes_on_every_run(tmp_path):
    """Pillow names the file object it could not read, address and all ("cannot identify image
    file <_io.BytesIO object at 0x7f...>"): the reject names the image instead, so two runs on
    the same rows write the same rejects.parquet."""
    import base64

    from tests.helpers import vlmshard

    junk = base64.b64encode(b"this is not an image" * 8).decode()
    rows = [{"image": f"data:image/png;base64,{junk}", "conversations": _conv("Look.", "Ok.", 1)},
            {"conversations": _conv("Hi.", "Hello.")}]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    written = []
    for run in ("a", "b"):  # separate processes: the objects live at other addresses
        vlmshard("preprocess", str(path), "--out", str(tmp_path / run), "--workers", "1")
        written.append((tmp_path / run / "rejects.parquet").read_bytes())
    assert written[0] == written[1]
    assert pq.read_table(tmp_path / "a" / "rejects.parquet").to_pylist() == [
        {"source": "rows", "row": 0, "reason": "corrupt_image",
         "message": "cannot parse image header of embedded image 0: cannot identify image file "
                    "embedded image 0"}]


def test_an_object_address_never_reaches_a_reject_message():
    from vlmshard.rejects import Reject

    r = Reject("corrupt_image", "x: <_io.BytesIO object at 0x7f7d02f41300> and <a.B object at "
                                "0xDEAD>")
    assert r.message == "x: <_io.BytesIO> and <a.B>"
