"""Videos through preprocess, pack, write and the loader (Qwen2/2.5-VL, Qwen3-VL and InternVL).

Expected values come from outside the code under test: PyAV decoding every frame (the probe's
counts, the frames at the recorded indices), the video processors' sampling and resize rules
written out here from ``transformers``' source (``torch.arange`` as they call it), and
``get_rope_index`` of the model itself for positions.
"""

from __future__ import annotations

import io
import json
import math
import subprocess
import sys

import av
import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from hf_reference import make_folder, make_shards
from image_references import smart_resize
from PIL import Image

from vlmshard.families.internvl import InternVLTiling
from vlmshard.families.qwen2vl import Qwen2VLTiling
from vlmshard.families.qwen3vl import Qwen3VLTiling
from vlmshard.preprocess import PreprocessConfig, run_preprocess
from vlmshard.demo.clips import Clip, make_clip
from vlmshard.preprocess.videos import read_video_header
from vlmshard.shards.loader import ShardDataset

FAMILIES = ("qwen2_5_vl", "internvl", "qwen3_vl")


def _photo() -> Image.Image:
    from skimage import data

    return Image.fromarray(data.astronaut())


def _decode_all(data: bytes) -> list[np.ndarray]:
    with av.open(io.BytesIO(data)) as container:
        return [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]


@pytest.mark.parametrize("container", ["mp4", "mkv", "webm", "avi"])
def test_probe_counts_what_decoding_every_frame_finds(container):
    clip = Clip(frames=13, fps=6, width=96, height=64, container=container)
    data = make_clip(_photo(), clip)
    header = read_video_header(f"clip.{container}", data)
    frames = _decode_all(data)
    assert header.frames == len(frames) == 13
    assert (header.width, header.height) == (96, 64) == frames[0].shape[1::-1]
    assert header.fps == pytest.approx(6)


@pytest.mark.parametrize("container", ["mp4", "mkv", "webm", "avi"])
def test_a_clip_is_the_same_bytes_from_every_fresh_process(container):
    """Same arguments, same bytes, as the demo data's rerun needs: each encode in a process of
    its own. (Two encodes in one long-lived pytest worker differed twice in about 16 suite
    runs, never in isolation or in 800 back-to-back encodes under load; cause unknown, so this
    test does not rest on a worker's state. On a difference it says from which packet.)"""
    code = ("import sys; from PIL import Image; from skimage import data; "
            "from vlmshard.demo.clips import Clip, make_clip; "
            "sys.stdout.buffer.write(make_clip(Image.fromarray(data.astronaut()), Clip("
            f"frames=13, fps=6, width=96, height=64, container={container!r})))")
    first, second = (subprocess.run([sys.executable, "-c", code], capture_output=True,
                                    check=True).stdout for _ in range(2))
    assert first, "no clip written"
    assert first == second, f"packet sizes {_packet_sizes(first)} / {_packet_sizes(second)}"


def _packet_sizes(data: bytes) -> list[int]:
    with av.open(io.BytesIO(data)) as container:
        return [p.size for p in container.demux(video=0) if p.size]


def _qwen_reference(total: int, fps: float, width: int, height: int, *, target=2.0,
                    min_frames=4, max_frames=768, min_pixels=128 * 28 * 28,
                    max_pixels=768 * 28 * 28, max_video_tokens=128000):
    """Qwen2VLVideoProcessor.sample_frames (fps), resize with cap_pixels_per_frame, padding."""
    most = math.floor(min(max_frames, total) / 2) * 2
    n = math.floor(min(max(total / fps * target, min_frames), most, total) / 2) * 2
    indices = torch.arange(0, total, total / n).int().tolist()  # may hold n + 1
    sampled = len(indices)  # what the processor's resize and sampled_fps count
    budget = int(max_video_tokens * 28 * 28 * 0.9)
    cap = max(min(max_pixels, budget * 2 // sampled), int(min_pixels * 1.05))
    h, w = smart_resize(width, height, 28, min_pixels, cap)
    indices += indices[-1:] * (len(indices) % 2)
    grid = (len(indices) // 2, h // 14, w // 14)
    return indices, grid, 2 / (sampled / total * fps)


@pytest.mark.parametrize("total,fps,width,height", [
    (300, 30, 640, 480), (48, 24, 1280, 720), (9, 30, 64, 48), (7000, 25, 1920, 1080),
    (101, 29.97, 480, 854), (20, 8, 128, 96), (230, 30, 640, 360)])
def test_frame_sampling_follows_each_video_processor(total, fps, width, height):
    indices, grid, seconds = _qwen_reference(total, fps, width, height)
    got = Qwen2VLTiling().sample_video(total, fps, width, height)
    assert list(got.indices) == indices and got.grid == grid
    assert got.tokens == got.tiles == grid[0] * grid[1] * grid[2] // 4
    assert got.seconds_per_step == pytest.approx(seconds)
    # InternVLVideoProcessor.sample_frames: the middle of num_frames equal segments
    n = min(8, total)
    want = torch.arange(total / n / 2, total, total / n).int().tolist()
    got = InternVLTiling().sample_video(total, fps, width, height)
    assert list(got.indices) == want and got.tiles == n and got.tokens == 256 * n
    # a frame list is taken as sampled: every frame, the last repeated to whole patches
    got = Qwen2VLTiling().sample_video(3, 2.0, width, height, given=True)
    assert got.indices == (0, 1, 2, 2) and got.seconds_per_step == 1.0
    # Qwen3VLVideoProcessor: linspace over the clip, rounded; one pixel budget for all frames
    n = min(max(int(total / fps * 2), 4), 768, total)
    want = np.linspace(0, total - 1, n).round().astype(int).tolist()
    h, w = _qwen3_resize(n, width, height)
    want += want[-1:] * (n % 2)
    policy = Qwen3VLTiling(patch_size=16, video_min_pixels=4096, video_max_pixels=25165824)
    got = policy.sample_video(total, fps, width, height)
    assert list(got.indices) == want and got.grid == (len(want) // 2, h // 16, w // 16)
    times = [(want[k] / fps + want[k + 1] / fps) / 2 for k in range(0, len(want), 2)]
    assert got.timestamps == pytest.approx(times)


def _qwen3_resize(n: int, width: int, height: int, min_pixels=4096, max_pixels=25165824):
    """Qwen3-VL's video smart_resize: the budget over round(n / 2) · 2 frames of 32-px units."""
    if height < 32 or width < 32:
        scale = max(32 / height, 32 / width)
        height, width = int(height * scale), int(width * scale)
    h, w, t = round(height / 32) * 32, round(width / 32) * 32, round(n / 2) * 2
    if t * h * w > max_pixels:
        beta = math.sqrt(n * height * width / max_pixels)
        h = max(32, math.floor(height / beta / 32) * 32)
        w = max(32, math.floor(width / beta / 32) * 32)
    elif t * h * w < min_pixels:
        beta = math.sqrt(min_pixels / (n * height * width))
        h, w = math.ceil(height * beta / 32) * 32, math.ceil(width * beta / 32) * 32
    return h, w


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> dict[str, tuple[str, str]]:
    out = {}
    for family in FAMILIES:
        root = tmp_path_factory.mktemp(family)
        folder = make_folder(family, str(root / "model"))
        out[family] = folder, make_shards(folder, root, rows="videos", target_samples=4)
    return out


def _stats(shards_root: str) -> dict[int, dict]:
    pre = shards_root.rsplit("/", 1)[0] + "/pre"
    return {r["sample_id"]: r for r in pq.read_table(f"{pre}/stats").to_pylist()}


@pytest.mark.parametrize("family", FAMILIES)
def test_loader_frames_are_the_frames_at_the_recorded_indices(family, shards):
    folder, root = shards[family]
    dataset = ShardDataset(root, pixel_dtype=torch.float32, pad_to_caps=False)
    policy = next(iter(dataset.policies.values()))
    stats = _stats(root)
    seen = 0
    for record in dataset.records():
        batch = dataset.collate(record)
        row = 0
        for sample in record.samples:
            stat = stats[sample["sample_id"]]
            videos = {v["item"]: v for v in stat["videos"]}
            for item in range(stat["n_images"] + len(videos)):
                if item not in videos:
                    k = sum(1 for i in range(item) if i not in videos)
                    row += stat["image_tiles"][k] * dataset.rows_per_tile
                    continue
                video = videos[item]
                if video["frame_list"]:
                    frames = [np.asarray(Image.open(p).convert("RGB")) for p in video["paths"]]
                else:
                    with open(video["paths"][0], "rb") as f:
                        frames = _decode_all(f.read())
                assert video["total_frames"] == len(frames)
                want = policy.video_pixels([Image.fromarray(frames[i]) for i in video["frames"]],
                                           policy.sample_video(video["total_frames"],
                                                               video["fps"], video["w"],
                                                               video["h"], video["frame_list"]))
                rows = video["tiles"] * dataset.rows_per_tile
                got = batch["pixel_values"][row:row + rows].numpy()
                np.testing.assert_array_equal(got, want.reshape(got.shape))
                row += rows
                seen += 1
    assert seen == 3


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_video_positions_equal_get_rope_index(family, shards):
    """Qwen2.5-VL: the temporal axis steps by tokens_per_second × seconds per temporal patch;
    Qwen3-VL: each temporal step a grid of its own between its timestamp texts; the text after
    a video resumes as the model's own ``get_rope_index`` has it."""
    from transformers import AutoConfig, AutoModel

    folder, root = shards[family]
    with torch.device("meta"):
        model = AutoModel.from_config(AutoConfig.from_pretrained(folder))
    dataset = ShardDataset(root)
    image, video = model.config.image_token_id, model.config.video_token_id
    checked = 0
    for record in dataset.records():
        batch = dataset.collate(record)
        cu = batch["cu_seqlens"].tolist()
        items = 0
        for sample, lo, hi in zip(record.samples, cu, cu[1:]):
            ids = batch["input_ids"][lo:hi]
            n = len(sample["images"]) + len(sample.get("videos", ()))
            grids = batch["image_grid_thw"][items:items + n]
            is_video = batch["media_is_video"][items:items + n]
            seconds = batch["media_seconds_per_step"][items:items + n]
            items += n
            if not n:
                continue
            kwargs = {"image_grid_thw": grids[~is_video] if (~is_video).any() else None,
                      "video_grid_thw": grids[is_video] if is_video.any() else None}
            if family == "qwen2_5_vl":
                kwargs["second_per_grid_ts"] = seconds[is_video] if is_video.any() else None
            types = (ids == image).int() + 2 * (ids == video).int()
            want, _ = model.get_rope_index(ids[None], mm_token_type_ids=types[None], **kwargs)
            assert torch.equal(batch["position_ids"][:, lo:hi], want[:, 0]), record.where
            checked += bool(is_video.any())
    assert checked == 3



@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_the_packers_vit_cost_is_the_trainers_count_of_each_samples_grids(family, shards):
    """The packer's ViT cost of a sample (``a_v``·tiles + ``a_vs``·Σ tiles² over its units, from
    the stats alone) against the trainer's count of what its ViT runs: the model's FLOPs per
    tile and per squared patch span (``training_flops``, held to ``FlopCounterMode`` in
    test_flops) over the grids the loader hands the model (held to the processors above).
    Qwen3-VL attends across each image and video step: equal. Qwen2.5-VL's windowed blocks are
    charged as whole windows: the packer's count is at or above, by what the windows cut at an
    image's edge leave out."""
    from vlmshard.families import model_sizes
    from vlmshard.io import read_json
    from vlmshard.model_sizes import CostTerms, training_flops, vit_attention_size
    from vlmshard.packing.cost import CostModel
    from vlmshard.packing.stats import load_stats

    folder, root = shards[family]
    model = model_sizes(read_json(f"{folder}/config.json"), folder)
    cost, flops = CostModel.from_sizes(model), training_flops(model)
    lengths = load_stats(root.rsplit("/", 1)[0] + "/pre").lengths
    dataset = ShardDataset(root)
    checked = 0
    for record in dataset.records():
        batch = dataset.collate(record)
        items = 0
        for sample in record.samples:
            n = len(sample["images"]) + len(sample.get("videos", ()))
            grids = batch["image_grid_thw"][items:items + n].tolist()
            items += n
            i = sample["sample_id"]
            tiles = sum(t * h * w for t, h, w in grids) / model.patches_per_tile
            assert tiles == lengths.tiles[i]
            runs = flops.dot(CostTerms(tiles=tiles) + vit_attention_size(model.vision, grids))
            packed = cost.cost(lengths.tiles[i], 0, 0, 0, lengths.unit_squares[i])
            if family == "qwen3_vl":
                assert packed == pytest.approx(runs, rel=1e-12)
            else:
                assert runs <= packed <= 1.5 * runs
            checked += bool(n)
    assert checked >= 3

BAD = {  # row id: (what the row holds, the reason it must get)
    "corrupt": ("garbage.mp4", "corrupt_video"),
    "truncated": ("cut.mp4", "truncated_video"),
    "audio_only": ("audio.m4a", "no_video_stream"),
    "codec": ("unknown.mp4", "unsupported_codec"),
    "long": ("long.mp4", "video_too_long"),
    "missing": ("nowhere.mp4", "missing_video"),
    "mismatch": ("pan.mp4", "video_count_mismatch"),
    "sizes": (["a.png", "b.png"], "corrupt_video"),
    "zero_frames": ("empty.mkv", "empty_video"),
    "cut_mkv": ("cut.mkv", "truncated_video"),  # MKV states no frame count: its duration
    "still": ("a.png", "no_video_stream"),
    "empty_list": ([], "empty_video"),
}


def _bad_files(root) -> None:
    pan = make_clip(_photo(), Clip(frames=16, fps=8))
    (root / "pan.mp4").write_bytes(pan)
    (root / "garbage.mp4").write_bytes(b"not a video, " * 64)
    # moov at the end: half the file has its header but not the index
    (root / "cut.mp4").write_bytes(pan[: len(pan) // 2])
    (root / "unknown.mp4").write_bytes(pan.replace(b"avc1", b"zzzz"))
    (root / "long.mp4").write_bytes(make_clip(_photo(), Clip(frames=40, fps=8)))  # 5 s
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as c:
        stream = c.add_stream("aac", rate=8000)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 1024), np.float32), format="fltp",
                                           layout="mono")
        frame.sample_rate = 8000
        c.mux(stream.encode(frame))
        c.mux(stream.encode())
    (root / "audio.m4a").write_bytes(buf.getvalue())
    buf = io.BytesIO()  # a video stream that holds no frame (the audio writes the header)
    with av.open(buf, "w", format="matroska") as c:
        video = c.add_stream("libx264", rate=8)
        video.width, video.height, video.pix_fmt = 64, 48, "yuv420p"
        audio = c.add_stream("aac", rate=8000)
        c.mux(audio.encode(frame))
        c.mux(audio.encode())
        c.mux(video.encode())
    (root / "empty.mkv").write_bytes(buf.getvalue())
    mkv = make_clip(_photo(), Clip(frames=16, fps=8, container="mkv"))
    (root / "cut.mkv").write_bytes(mkv[: len(mkv) * 8 // 10])
    _photo().resize((64, 48)).save(root / "a.png")
    _photo().resize((48, 64)).save(root / "b.png")


def test_bad_videos_are_rejects_with_their_reason(tmp_path):
    folder = make_folder("qwen2_5_vl", str(tmp_path / "model"))
    _bad_files(tmp_path)
    rows = []
    for name, (value, _) in BAD.items():
        text = "<video><video>" if name == "mismatch" else "<video>"
        rows.append({"id": name, "videos": [value], "conversations": [
            {"from": "human", "value": f"{text} What is it?"}, {"from": "gpt", "value": "No."}]})
    rows.append({"id": "good", "videos": ["pan.mp4"], "conversations": [
        {"from": "human", "value": "<video> What is it?"}, {"from": "gpt", "value": "A pan."}]})
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = run_preprocess(PreprocessConfig(inputs=[str(path)], out=str(tmp_path / "pre"),
                                             model=folder, workers=1, image_root=str(tmp_path),
                                             max_video_seconds=4))
    assert result.accepted + result.rejected == len(rows)
    assert result.accepted == 1
    rejects = pq.read_table(tmp_path / "pre" / "rejects.parquet").to_pylist()
    got = {list(BAD)[r["row"]]: r["reason"] for r in rejects}
    assert got == {name: reason for name, (_, reason) in BAD.items()}
    # a family without a video layout (Gemma 3): a reject naming it, not a crash
    text = {"id": "text", "conversations": [{"from": "human", "value": "Hi"},
                                            {"from": "gpt", "value": "Hello."}]}
    path.write_text(json.dumps(rows[-1]) + "\n" + json.dumps(text) + "\n")
    gemma = run_preprocess(PreprocessConfig(inputs=[str(path)], out=str(tmp_path / "gemma"),
                                            model=make_folder("gemma3", str(tmp_path / "g")),
                                            workers=1, image_root=str(tmp_path)))
    reasons = pq.read_table(tmp_path / "gemma" / "rejects.parquet").column("reason").to_pylist()
    assert reasons == ["unsupported_video"] and gemma.accepted == 1


def _video_text(family: str, video: dict) -> str:
    """A video's text as each family's published processor writes it, from the stats' frames,
    rate and grid. Qwen2-VL/2.5-VL: the template's ``<|vision_start|><|video_pad|><|vision_end|>``
    with the pad repeated t·h·w/4 times. Qwen3-VL: per temporal step ``<t.t seconds>`` (the mean
    of its two frames' index / fps) and its own ``<|vision_start|>``, h·w/4 pads,
    ``<|vision_end|>``, the template's pair replaced, as Qwen's processor (transformers 4.57)
    writes it. InternVL: ``Frame{i}: <img>`` + 256 ``<IMG_CONTEXT>`` + ``</img>`` lines joined by
    line breaks, then the template's own line break after ``<video>``."""
    t, h, w = video["grid"]
    if family == "qwen2_5_vl":
        return "<|vision_start|>" + "<|video_pad|>" * (t * h * w // 4) + "<|vision_end|>"
    if family == "qwen3_vl":
        frames, steps = video["frames"], []
        for k in range(0, len(frames), 2):
            seconds = (frames[k] / video["fps"] + frames[k + 1] / video["fps"]) / 2
            pads = "<|video_pad|>" * (h * w // 4)
            steps.append(f"<{seconds:.1f} seconds><|vision_start|>{pads}<|vision_end|>")
        return "".join(steps)
    return "\n".join(f"Frame{i + 1}: <img>" + "<IMG_CONTEXT>" * 256 + "</img>"
                     for i in range(len(video["frames"]))) + "\n"


@pytest.mark.parametrize("family", FAMILIES)
def test_each_video_is_written_as_its_processor_writes_it(family, shards):
    from transformers import AutoTokenizer

    folder, root = shards[family]
    tokenizer = AutoTokenizer.from_pretrained(folder)
    dataset = ShardDataset(root, pad_to_caps=False)
    stats = _stats(root)
    seen = 0
    for record in dataset.records():
        start = 0
        for sample in record.samples:
            ids = record.input_ids[start:start + sample["seq_len"]]
            start += sample["seq_len"]
            text = tokenizer.decode(ids.tolist())
            for video in stats[sample["sample_id"]]["videos"]:
                assert _video_text(family, video) in text
                seen += 1
            assert "<video>" not in text and "<|vision_start|><0." not in text
            assert "<|vision_end|><|vision_end|>" not in text
    assert seen == 3


def test_a_video_url_is_read_as_a_file_is(tmp_path):
    """A clip named by URL: fetched whole (with the image reader's retries), probed and sampled
    exactly as the same file on disk."""
    from helpers import serve_http

    folder = make_folder("internvl", str(tmp_path / "model"))
    (tmp_path / "www").mkdir()
    (tmp_path / "www" / "pan.mp4").write_bytes(make_clip(_photo(), Clip(frames=16, fps=8)))
    stats = {}
    with serve_http(tmp_path / "www") as base:
        for name, value in (("url", f"{base}/pan.mp4"), ("file", str(tmp_path / "www" /
                                                                      "pan.mp4"))):
            path = tmp_path / f"{name}.jsonl"
            path.write_text(json.dumps({"videos": [value], "conversations": [
                {"from": "human", "value": "<video>What moves?"},
                {"from": "gpt", "value": "The camera."}]}) + "\n")
            run_preprocess(PreprocessConfig(inputs=[str(path)], out=str(tmp_path / name),
                                            model=folder, workers=1))
            (row,) = pq.read_table(tmp_path / name / "stats").to_pylist()
            stats[name] = row
    assert stats["url"]["videos"][0]["paths"] == [f"{base}/pan.mp4"]
    for key in ("seq_len", "vit_tiles", "text_tokens"):
        assert stats["url"][key] == stats["file"][key]
    keys = ("frames", "total_frames", "fps", "w", "h", "tiles", "tokens", "bytes")
    assert {k: stats["url"]["videos"][0][k] for k in keys} == \
        {k: stats["file"]["videos"][0][k] for k in keys}


def _remuxed_with_first_frames_trimmed(clip: bytes, trimmed: int, fps: int) -> bytes:
    """``clip`` remuxed with its first ``trimmed`` packets before time 0, as a ``-c copy`` cut
    leaves them: an edit list tells the decoder to drop them."""
    out = io.BytesIO()
    with av.open(io.BytesIO(clip)) as source, av.open(out, "w", format="mp4") as target:
        stream = source.streams.video[0]
        copy = target.add_stream_from_template(stream)
        shift = trimmed * int(1 / (fps * stream.time_base))
        for packet in source.demux(stream):
            if packet.dts is None:
                continue
            packet.pts -= shift
            packet.dts -= shift
            packet.stream = copy
            target.mux(packet)
    return out.getvalue()


def test_a_trimmed_copy_counts_the_frames_it_shows():
    clip = _remuxed_with_first_frames_trimmed(make_clip(_photo(), Clip(frames=12, fps=8)), 3, 8)
    header = read_video_header("trimmed.mp4", clip)
    assert header.frames == len(_decode_all(clip)) == 9


def test_decode_videos_rejects_a_stream_that_stops_decoding(tmp_path):
    """A clip whose bytes are damaged past its first frames passes the probe (header, packets,
    first frame); ``--decode-videos`` decodes its sampled frames too and rejects it."""
    clip = bytearray(make_clip(_photo(), Clip(frames=16, fps=8)))
    start = len(clip) * 7 // 10
    clip[start:start + 200] = bytes(b ^ 0x5A for b in clip[start:start + 200])
    (tmp_path / "damaged.mp4").write_bytes(bytes(clip))
    assert read_video_header("damaged.mp4", bytes(clip)).frames == 16
    folder = make_folder("internvl", str(tmp_path / "model"))
    path = tmp_path / "rows.jsonl"
    rows = [{"videos": ["damaged.mp4"], "conversations": [
        {"from": "human", "value": "<video>What moves?"}, {"from": "gpt", "value": "It."}]},
        {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hi."}]}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    for decode, accepted in ((False, 2), (True, 1)):
        out = tmp_path / f"pre-{decode}"
        result = run_preprocess(PreprocessConfig(inputs=[str(path)], out=str(out), model=folder,
                                                 workers=1, image_root=str(tmp_path),
                                                 decode_videos=decode))
        assert result.accepted == accepted
    reasons = pq.read_table(tmp_path / "pre-True" / "rejects.parquet").column("reason")
    assert reasons.to_pylist() == ["corrupt_video"]


def test_video_sizes_come_from_the_video_config_alone(tmp_path):
    """A folder with a video config (``size``: the per-frame pixel range) beside an image config
    holding ``max_pixels``: transformers builds the video processor from the video config alone
    (``get_video_processor_dict``, which reads the image config only where there is no video
    config), so each clip takes the tokens ``Qwen2VLVideoProcessor``'s rule gives with the video
    ``size``, whatever the image's ``max_pixels``."""
    from transformers.video_processing_utils import BaseVideoProcessor

    from vlmshard.families import family_for_model_type, read_model_folder

    folder = make_folder("qwen2_5_vl", str(tmp_path / "model"))
    image_path, video_path = (tmp_path / "model" / name for name in (
        "preprocessor_config.json", "video_preprocessor_config.json"))
    image = json.loads(image_path.read_text())
    image.update(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 1024)
    image_path.write_text(json.dumps(image))
    video = json.loads(video_path.read_text())
    video["size"] = {"longest_edge": 28 * 28 * 48, "shortest_edge": 28 * 28 * 16}
    video_path.write_text(json.dumps(video))

    hf, _ = BaseVideoProcessor.get_video_processor_dict(folder, local_files_only=True)
    assert "max_pixels" not in hf  # the image config is not read
    policy = family_for_model_type("qwen2_5_vl", folder).tiling(read_model_folder(folder))
    more = 0
    for total, fps, width, height in [(300, 30, 640, 480), (48, 24, 1280, 720), (9, 30, 64, 48),
                                      (101, 29.97, 480, 854), (20, 8, 128, 96),
                                      (230, 30, 640, 360), (60, 10, 1920, 1080)]:
        _, grid, _ = _qwen_reference(
            total, fps, width, height, target=hf["fps"], min_frames=hf["min_frames"],
            max_frames=hf["max_frames"], min_pixels=hf["size"]["shortest_edge"],
            max_pixels=hf["size"]["longest_edge"])
        got = policy.sample_video(total, fps, width, height)
        assert got.grid == grid and got.tokens == grid[0] * grid[1] * grid[2] // 4
        more += smart_resize(width, height, 28, image["min_pixels"], image["max_pixels"]) != \
            smart_resize(width, height, 28, hf["size"]["shortest_edge"],
                         hf["size"]["longest_edge"])
    assert more >= 4  # the image's limits would size most of these clips otherwise
