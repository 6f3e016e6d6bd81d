"""``vlmshard demo-data``: a deterministic LLaVA-format demo dataset over scikit-image's photos.

The photos ship inside the ``scikit-image`` wheel (``skimage/data``), so nothing is downloaded.
They are cropped and resized to many sizes and aspect ratios (wide, tall, tiny, huge) and used by
the sources below, in every supported input format:

- ``captions`` (JSONL): one image, short question and answer
- ``docqa`` (JSON list): one wide, tall or huge image, long answers
- ``multi`` (Parquet): two to four images per sample
- ``chat`` (JSONL, subsampled by ``repeat_time: 0.5``): text only, multi-turn
- ``noisy`` (JSONL): one row per reject reason; each row's ``id`` names the reason it must get
- ``hub`` (Parquet as the Hugging Face Hub holds it): ``messages`` of role/content with
  ``<image>`` placeholders, the images embedded as a ``datasets`` ``Sequence(Image())`` column
- ``clips`` (JSONL): short videos made here from the photos (pans and zooms as MP4, MKV and
  WebM, a few embedded as ``data:`` URIs, some frame lists), asked about alone or beside an
  image: about a tenth of the demo's samples

``meta.json`` names them all, InternVL style. Same seed, same bytes.

The dataset and the demo's tiny model folder are each built once: a folder keeps a stamp of what
it was built from (the options, this code's and the builders' source, the versions of the
libraries that write the bytes) and of its files' hashes, and a rerun with the same inputs over
untouched files returns it as it is (``make demo`` twice does not build them twice).
"""

from __future__ import annotations

import glob
import importlib.metadata
import importlib.util
import io
import json
import logging
import os
import random
import struct
import zlib
from dataclasses import dataclass
from typing import Callable

from PIL import Image

from vlmshard.errors import JobError
from vlmshard.io import read_json, sha256_file, write_json_atomic
from vlmshard.jobs import fingerprint
from vlmshard.stage import Result, stage_command

from . import clips as _clips_module
from .clips import Clip, clip_frames, make_clip
from .config import DemoDataConfig, DemoModelConfig

log = logging.getLogger(__name__)

DESCRIPTION = __doc__

PHOTOS = ["astronaut.png", "chelsea.png", "coffee.png", "rocket.jpg", "retina.jpg",
          "hubble_deep_field.jpg", "motorcycle_left.png", "page.png", "text.png", "camera.png"]

# (label, width, height): the aspect ratios and extremes the tiling policies must handle.
SIZES = [
    ("square", 448, 448), ("photo", 640, 480), ("photo", 1024, 768), ("portrait", 480, 640),
    ("small", 336, 252), ("wide", 1792, 448), ("wide", 2400, 600), ("banner", 1600, 200),
    ("tall", 448, 1344), ("tall", 600, 2000), ("tiny", 24, 18), ("tiny", 64, 48),
    ("huge", 4096, 3072), ("huge", 3000, 3000), ("doc", 1240, 1754), ("doc", 1754, 1240),
]

WORDS = ("the a of to in is on for with that this image shows left right top bottom red blue "
         "green large small person cat coffee cup rocket launch galaxy star text page table "
         "figure chart value number answer question describe where what how many color shape "
         "object background foreground near far sky road building window light dark bright "
         "document line column row total sum average label title caption region detail "
         "motorcycle camera portrait astronaut flag suit helmet planet nebula retina "
         "vessel").split()

QUESTIONS = ["Describe the image.", "What is shown here?", "What color dominates the picture?",
             "Read the text in the image.", "How many objects are visible?",
             "Summarize the document.", "What is in the top left corner?"]


@dataclass(frozen=True)
class DemoDataset(Result):
    root: str
    meta: str
    images: list[str]
    sources: dict[str, str]

    def summary(self) -> str:
        return f"demo dataset -> {self.meta}"


@dataclass
class DemoModel(Result):
    model_type: str
    folder: str

    def summary(self) -> str:
        return f"tiny {self.model_type} -> {self.folder}"


def run_demo_model(cfg: DemoModelConfig) -> DemoModel:
    return DemoModel(cfg.model_type, demo_model(cfg.model_type, cfg.out))


def demo_model(model_type: str, path: str, **limits) -> str:
    """The demo's tiny model folder of ``model_type`` (random weights) at ``path``: a tokenizer
    that has seen the demo's words, the family's demo image limits (``limits``: others, as
    ``tiny_folder`` takes them). The same bytes every time; built once (``_built_once``)."""
    import vlmshard.families as families_package
    from vlmshard.families import family_for_model_type, tiny_folder
    from vlmshard.families.tiny import CORPUS

    limits = {**family_for_model_type(model_type, path).demo_limits, **limits}

    def build() -> dict:
        corpus = CORPUS + [" ".join(WORDS[i:] + WORDS[:i]) for i in range(0, len(WORDS), 7)]
        tiny_folder(model_type, path, corpus=corpus, vocab_size=1000, **limits)
        return {}

    code = [__file__, *glob.glob(os.path.join(os.path.dirname(families_package.__file__), "*.py"))]
    _built_once(path, {"model_type": model_type, "limits": limits, "code": _sources_hash(code),
                       "versions": _versions("transformers", "tokenizers", "torch",
                                             "safetensors")}, build)
    return path


STAMP = ".vlmshard-built.json"  # what a demo folder was built from, and its files' hashes


def _built_once(out: str, inputs: dict, build: Callable[[], dict]) -> dict:
    """``build()``'s result (JSON), building into ``out`` only where it does not hold what
    ``inputs`` build: its stamp must name the same inputs and each of its files, unchanged."""
    path = os.path.join(out, STAMP)
    key = fingerprint(inputs)
    stamp = read_json(path) if os.path.isfile(path) else {}
    if stamp.get("key") == key and stamp.get("files") == _file_hashes(out):
        return stamp["result"]
    result = build()
    write_json_atomic(path, {"key": key, "inputs": inputs, "files": _file_hashes(out),
                             "result": result})
    return result


def _file_hashes(out: str) -> dict[str, str]:
    """{path under ``out``: SHA-256} of every file but the stamp."""
    hashes = {}
    for folder, _, names in os.walk(out):
        for name in names:
            rel = os.path.relpath(os.path.join(folder, name), out)
            if rel != STAMP:
                hashes[rel] = sha256_file(os.path.join(folder, name))
    return dict(sorted(hashes.items()))


def _sources_hash(paths: list[str]) -> dict[str, str]:
    """{file name: SHA-256} of the code that writes a demo folder."""
    return {os.path.basename(p): sha256_file(p) for p in sorted(paths)}


def _versions(*distributions: str) -> dict[str, str]:
    """The installed versions of the libraries whose output is in a demo folder's bytes."""
    return {name: importlib.metadata.version(name) for name in distributions}


def skimage_photo_dir() -> str:
    spec = importlib.util.find_spec("skimage")
    if spec is None or not spec.submodule_search_locations:
        raise JobError("scikit-image is not installed; it ships the demo photos")
    return os.path.join(list(spec.submodule_search_locations)[0], "data")


def _write_if_changed(path: str, data: bytes) -> None:
    """Rewrite only what changed, so file mtimes (part of a preprocess job's identity) hold still
    and a second ``make demo`` finds its preprocess job already complete."""
    try:
        with open(path, "rb") as f:
            if f.read() == data:
                return
    except FileNotFoundError:
        pass
    with open(path, "wb") as f:
        f.write(data)


def _sentence(rng: random.Random, n_words: int) -> str:
    words = [rng.choice(WORDS) for _ in range(n_words)]
    return " ".join(words).capitalize() + "."


def _answer(rng: random.Random, lo: int, hi: int) -> str:
    n = rng.randint(lo, hi)
    sentences, used = [], 0
    while used < n:
        k = min(n - used, rng.randint(6, 18))
        sentences.append(_sentence(rng, k))
        used += k
    return " ".join(sentences)


def _make_images(out: str, rng: random.Random) -> list[str]:
    """Crop/resize the photos to every size in SIZES; JPEG and PNG alternate."""
    photo_dir = skimage_photo_dir()
    photos = [Image.open(os.path.join(photo_dir, p)).convert("RGB")
              for p in PHOTOS if os.path.exists(os.path.join(photo_dir, p))]
    os.makedirs(os.path.join(out, "images"), exist_ok=True)
    names = []
    for k, (label, w, h) in enumerate(SIZES * 2):
        photo = photos[k % len(photos)]
        pw, ph = photo.size
        # Largest crop of the photo with the target aspect ratio, at a seeded offset.
        cw, ch = ((pw, max(1, round(pw * h / w))) if pw * h <= ph * w
                  else (max(1, round(ph * w / h)), ph))
        x0, y0 = rng.randint(0, pw - cw), rng.randint(0, ph - ch)
        image = photo.crop((x0, y0, x0 + cw, y0 + ch)).resize((w, h), Image.BICUBIC)
        ext = "jpg" if k % 2 == 0 else "png"
        name = f"images/{label}-{k:02d}-{w}x{h}.{ext}"
        buf = io.BytesIO()
        # PNG at zlib level 1: 4x faster to write than the default 6 for 14% more bytes, the
        # same pixels (the demo is written at every fresh test and `make demo`)
        image.save(buf, format="JPEG" if ext == "jpg" else "PNG", quality=90, compress_level=1)
        _write_if_changed(os.path.join(out, name), buf.getvalue())
        names.append(name)
    return names


VIDEO_QUESTIONS = ["What happens in the video?", "Where does the camera move?",
                   "Describe the clip.", "What is shown at the end?"]


def _make_clips(out: str, rng: random.Random) -> tuple[list[str], list[str]]:
    """Clips of the photos (a pan or a zoom each, 1 to 4 s at 8 fps, as MP4, MKV or WebM), and
    the six frames of one more zoom as JPEG files (a frame list)."""
    photo_dir = skimage_photo_dir()
    os.makedirs(os.path.join(out, "clips"), exist_ok=True)
    names = []
    for k, photo in enumerate(PHOTOS[:8]):
        path = os.path.join(photo_dir, photo)
        if not os.path.exists(path):
            continue
        container = ("mp4", "mkv", "webm")[k % 3]
        clip = Clip(frames=rng.choice((8, 16, 24, 32)), fps=8, width=rng.choice((160, 256)),
                    height=rng.choice((120, 144)), motion=("pan", "zoom")[k % 2],
                    container=container)
        with Image.open(path) as im:
            data = make_clip(im, clip)
        name = f"clips/{clip.motion}-{k:02d}.{container}"
        _write_if_changed(os.path.join(out, name), data)
        names.append(name)
    frames = []
    with Image.open(os.path.join(photo_dir, PHOTOS[0])) as im:
        for j, frame in enumerate(clip_frames(im, Clip(frames=6, width=224, height=168,
                                                       motion="zoom"))):
            buf = io.BytesIO()
            frame.save(buf, format="JPEG", quality=90)
            frames.append(f"clips/frames/{j:03d}.jpg")
            os.makedirs(os.path.join(out, "clips", "frames"), exist_ok=True)
            _write_if_changed(os.path.join(out, frames[-1]), buf.getvalue())
    return names, frames


def _clip_rows(out: str, clips: list[str], frames: list[str], images: list[str],
               rng: random.Random, n: int) -> list[dict]:
    """Rows with a video: a clip alone (LLaVA ``<video>``), a clip after an image, a clip as
    an embedded ``data:`` URI in a typed item, or the frame list at 2 fps."""
    import base64

    rows = []
    for i in range(n):
        kind = i % 5
        clip = rng.choice(clips)
        answer = _answer(rng, 10, 120)
        if kind == 3:
            with open(os.path.join(out, clip), "rb") as f:
                uri = "data:video/mp4;base64," + base64.b64encode(f.read()).decode()
            rows.append({"id": f"clip-{i}", "messages": [
                {"role": "user", "content": [{"type": "video", "video": uri},
                                             {"type": "text", "text": rng.choice(
                                                 VIDEO_QUESTIONS)}]},
                {"role": "assistant", "content": answer}]})
        elif kind == 4:
            rows.append({"id": f"clip-{i}", "videos": [frames], "fps": 2, "conversations": [
                {"from": "human", "value": "<video>\nWhat changes?"},
                {"from": "gpt", "value": answer}]})
        else:
            image = "<image>\n" if kind == 2 else ""
            row = {"id": f"clip-{i}", "videos": [clip], "conversations": [
                {"from": "human", "value": f"{image}<video>\n{rng.choice(VIDEO_QUESTIONS)}"},
                {"from": "gpt", "value": answer}]}
            if image:
                row["image"] = rng.choice(images)
            rows.append(row)
    return rows


def _conv(question: str, answer: str, n_images: int) -> list[dict]:
    tags = "".join("<image>\n" for _ in range(n_images))
    return [{"from": "human", "value": tags + question}, {"from": "gpt", "value": answer}]


def _write_jsonl(path: str, rows: list[dict]) -> None:
    text = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    _write_if_changed(path, text.encode("utf-8"))


def _bad_images(out: str) -> dict[str, str]:
    """Image files that must be rejected, each named after the reason it triggers."""
    bad = os.path.join(out, "images", "bad")
    os.makedirs(bad, exist_ok=True)
    good = os.path.join(out, "images", "photo-01-640x480.png")
    with open(os.path.join(out, "images", "photo-02-1024x768.jpg"), "rb") as f:
        jpeg = f.read()
    files = {
        "empty_image": b"",
        "corrupt_image": b"this is not an image, only text that pretends to be one\n" * 4,
        "truncated_image": jpeg[: len(jpeg) // 2],
        "decompression_bomb": _png_with_size(good, 30000, 30000),
    }
    paths = {}
    for reason, data in files.items():
        ext = "png" if reason == "decompression_bomb" else "jpg"
        paths[reason] = f"images/bad/{reason}.{ext}"
        _write_if_changed(os.path.join(out, paths[reason]), data)
    with Image.open(good) as im:
        clip = make_clip(im, Clip(frames=8))
    videos = {"clip": clip, "truncated_video": clip[: len(clip) // 2],
              "corrupt_video": b"this is not a video either\n" * 8}
    for reason, data in videos.items():
        paths[reason] = f"images/bad/{reason}.mp4"
        _write_if_changed(os.path.join(out, paths[reason]), data)
    return paths


def _png_with_size(png_path: str, width: int, height: int) -> bytes:
    """A valid PNG whose header claims ``width``×``height``: a bomb without the pixels."""
    with open(png_path, "rb") as f:
        data = bytearray(f.read())
    ihdr = 8  # signature, then the IHDR chunk: length(4) type(4) data(13) crc(4)
    data[ihdr + 8: ihdr + 16] = struct.pack(">II", width, height)
    crc = zlib.crc32(bytes(data[ihdr + 4: ihdr + 8 + 13])) & 0xFFFFFFFF
    data[ihdr + 21: ihdr + 25] = struct.pack(">I", crc)
    return bytes(data)


def _noisy_rows(bad: dict[str, str], good_image: str) -> list[bytes]:
    """One JSONL line per reject reason (``id`` = expected reason), plus two good rows."""
    ok = _conv("Describe the image.", "A photo.", 1)

    def line(row: dict) -> bytes:
        return json.dumps(row).encode("utf-8")

    rows = [
        line({"id": "accepted-1", "image": good_image, "conversations": ok}),
        b'{"id": "malformed_json", "conversations": [',
        (b'{"id": "undecodable_text", "conversations": [{"from": "human", '
         b'"value": "caf\xe9 \xff"}]}'),
        line({"id": "missing_field", "image": good_image}),
        line({"id": "bad_field", "image": 42, "conversations": ok}),
        line({"id": "bad_role", "conversations": [{"from": "robot", "value": "beep"},
                                                  {"from": "gpt", "value": "boop"}]}),
        line({"id": "no_assistant_turn", "conversations": [{"from": "human", "value": "hi"}]}),
        line({"id": "image_count_mismatch", "image": good_image,
              "conversations": _conv("Compare.", "Same.", 2)}),
        line({"id": "missing_image", "image": "images/does-not-exist.jpg", "conversations": ok}),
        *[line({"id": reason, "image": path, "conversations": ok}) for reason, path in bad.items()
          if reason.endswith("_image") or reason == "decompression_bomb"],
        line({"id": "too_long", "conversations": _conv("Write a lot.", "word " * 9000, 0)}),
        line({"id": "video_count_mismatch", "videos": [bad["clip"]], "conversations": [
            {"from": "human", "value": "<video><video>Compare."}, {"from": "gpt", "value": "."}]}),
        *[line({"id": reason, "videos": [bad[reason]], "conversations": [
            {"from": "human", "value": "<video>What happens?"}, {"from": "gpt", "value": "."}]})
          for reason in ("truncated_video", "corrupt_video")],
        line({"id": "accepted-2", "conversations": _conv("Say hi.", "Hi.", 0)}),
    ]
    return rows


def generate(out: str, seed: int = 0, scale: int = 1) -> DemoDataset:
    """Write the demo dataset under ``out`` (once: ``_built_once``); ``scale`` multiplies the
    number of samples."""
    inputs = {"seed": seed, "scale": scale,
              "code": _sources_hash([__file__, _clips_module.__file__]),
              "versions": _versions("scikit-image", "pillow", "av", "numpy", "pyarrow",
                                    "datasets")}
    made = _built_once(out, inputs, lambda: _generate(out, seed, scale))
    log.info("demo dataset: %d images, %d sources -> %s", len(made["images"]),
             len(made["sources"]), out)
    return DemoDataset(root=out, meta=os.path.join(out, "meta.json"), images=made["images"],
                       sources=made["sources"])


def _generate(out: str, seed: int, scale: int) -> dict:
    """Write the demo dataset under ``out``: {"images": their paths, "sources": their files}."""
    rng = random.Random(seed)
    os.makedirs(out, exist_ok=True)
    images = _make_images(out, rng)
    clips, frames = _make_clips(out, random.Random(seed + 1))
    by_label: dict[str, list[str]] = {}
    for name in images:
        by_label.setdefault(os.path.basename(name).split("-")[0], []).append(name)
    docs = (by_label["wide"] + by_label["tall"] + by_label["huge"] + by_label["doc"]
            + by_label["banner"])

    captions = [{"id": f"cap-{i}", "image": rng.choice(images),
                 "conversations": _conv(rng.choice(QUESTIONS), _answer(rng, 5, 60), 1)}
                for i in range(80 * scale)]
    docqa = []
    for i in range(50 * scale):
        turns = []
        for t in range(rng.randint(1, 3)):
            turns += _conv(rng.choice(QUESTIONS), _answer(rng, 30, 400), 1 if t == 0 else 0)
        docqa.append({"id": f"doc-{i}", "image": rng.choice(docs), "conversations": turns})
    multi = []
    for i in range(40 * scale):
        k = rng.randint(2, 4)
        multi.append({"id": f"multi-{i}", "image": rng.sample(images, k),
                      "conversations": _conv("Compare these images.", _answer(rng, 20, 200), k)})
    chat = []
    for i in range(40 * scale):
        turns = [{"from": "system", "value": "You are a helpful assistant."}] if i % 3 == 0 else []
        for _ in range(rng.randint(1, 4)):
            turns += _conv(_sentence(rng, rng.randint(4, 20)), _answer(rng, 10, 300), 0)
        chat.append({"id": f"chat-{i}", "conversations": turns})

    hub = []
    small = [name for name in images if not name.startswith(("images/huge", "images/doc"))]
    for i in range(40 * scale):
        k = rng.randint(1, 2)
        messages = [{"role": "system", "content": "Answer in one sentence."}] if i % 4 == 0 else []
        messages += [{"role": "user", "content": "<image>" * k + rng.choice(QUESTIONS)},
                     {"role": "assistant", "content": _answer(rng, 10, 120)}]
        hub.append({"images": rng.sample(small, k), "messages": messages})
    clip_rows = _clip_rows(out, clips, frames, images, random.Random(seed + 2), 28 * scale)

    sources = {
        "captions": "captions.jsonl",
        "docqa": "docqa.json",
        "multi": "multi.parquet",
        "chat": "chat.jsonl",
        "noisy": "noisy.jsonl",
        "hub": "hub.parquet",
        "clips": "clips.jsonl",
    }
    _write_jsonl(os.path.join(out, sources["captions"]), captions)
    _write_if_changed(os.path.join(out, sources["docqa"]), json.dumps(docqa, indent=1).encode())
    import pyarrow as pa
    import pyarrow.parquet as pq

    buf = pa.BufferOutputStream()
    pq.write_table(pa.Table.from_pylist(multi), buf)
    _write_if_changed(os.path.join(out, sources["multi"]), buf.getvalue().to_pybytes())
    _write_jsonl(os.path.join(out, sources["chat"]), chat)
    _write_if_changed(os.path.join(out, sources["noisy"]),
                      b"\n".join(_noisy_rows(_bad_images(out), images[1])) + b"\n")
    _write_if_changed(os.path.join(out, sources["hub"]), _hub_parquet(out, hub))
    _write_jsonl(os.path.join(out, sources["clips"]), clip_rows)

    meta = {name: {"root": ".", "annotation": path, "repeat_time": 1}
            for name, path in sources.items()}
    meta["chat"]["repeat_time"] = 0.5  # subsampled, as InternVL meta files allow
    _write_if_changed(os.path.join(out, "meta.json"), json.dumps(meta, indent=1).encode())
    return {"images": images, "sources": sources}


def _hub_parquet(out: str, rows: list[dict]) -> bytes:
    """Rows as ``datasets`` writes a Hub dataset: each image's bytes embedded, 16 rows per row
    group."""
    import datasets

    features = datasets.Features({
        "images": datasets.Sequence(datasets.Image()),
        "messages": [{"role": datasets.Value("string"), "content": datasets.Value("string")}]})

    def embedded(name: str) -> dict:
        with open(os.path.join(out, name), "rb") as f:
            return {"bytes": f.read(), "path": os.path.basename(name)}

    table = datasets.Dataset.from_list(
        [{**row, "images": [embedded(name) for name in row["images"]]} for row in rows],
        features=features)
    buf = io.BytesIO()
    table.to_parquet(buf, batch_size=16)
    return buf.getvalue()


def run_demo_data(cfg: DemoDataConfig) -> DemoDataset:
    """``vlmshard demo-data``: :func:`generate` with the command's options."""
    return generate(cfg.out, cfg.seed, cfg.scale)


add_arguments, main = stage_command("demo-data", DemoDataConfig,
                                    "vlmshard.demo.data:run_demo_data")
