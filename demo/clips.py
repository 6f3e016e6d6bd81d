"""Short video clips made from a still photo (pans and zooms), encoded offline with PyAV: the
demo's videos and the tests'. Same arguments, same bytes from a fresh process (x264 and the
muxers in bit-exact mode); two encodes in one long-lived test worker have rarely differed, cause
unknown (``tests/test_video.py``).
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import numpy as np

if TYPE_CHECKING:
    from PIL import Image

Motion = Literal["pan", "zoom"]
CODECS = {"mp4": "libx264", "mkv": "libx264", "webm": "libvpx-vp9", "avi": "mpeg4"}
FORMATS = {"mp4": "mp4", "mkv": "matroska", "webm": "webm", "avi": "avi"}


@dataclass(frozen=True)
class Clip:
    frames: int = 16
    fps: float = 8
    width: int = 128
    height: int = 96
    motion: Motion = "pan"
    container: str = "mp4"  # mp4, mkv, webm or avi

    def __post_init__(self) -> None:
        if self.width % 2 or self.height % 4:
            raise ValueError(f"clip size {self.width}x{self.height}: yuv420p planes need an "
                             "even width and a height divisible by 4")


def clip_frames(photo: "Image.Image", clip: Clip) -> list["Image.Image"]:
    """The clip's frames as RGB images: a window over the photo that moves left to right
    (``pan``) or closes in on its centre (``zoom``), resized to the clip's size."""
    from PIL import Image

    photo = photo.convert("RGB")
    w, h = photo.size
    out = []
    for k in range(clip.frames):
        s = k / max(1, clip.frames - 1)
        if clip.motion == "pan":
            cw, ch = w * 0.6, h * 0.6
            x0, y0 = s * (w - cw), (h - ch) / 2
        else:
            scale = 1 - 0.5 * s
            cw, ch = w * scale, h * scale
            x0, y0 = (w - cw) / 2, (h - ch) / 2
        box = (x0, y0, x0 + cw, y0 + ch)
        out.append(photo.resize((clip.width, clip.height), Image.Resampling.BILINEAR, box=box))
    return out


def encode_clip(frames: list["Image.Image"], clip: Clip) -> bytes:
    """``frames`` encoded as the clip's container and codec (yuv420p)."""
    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format=FORMATS[clip.container],
                 options={"fflags": "+bitexact"}) as container:
        # one encoder thread: x264's and libvpx's output then cannot depend on scheduling
        stream = container.add_stream(CODECS[clip.container], rate=round(clip.fps),
                                      options={"threads": "1"})
        stream.width, stream.height, stream.pix_fmt = clip.width, clip.height, "yuv420p"
        stream.codec_context.flags |= av.codec.context.Flags.bitexact
        for image in frames:
            frame = av.VideoFrame.from_ndarray(yuv420p(np.asarray(image)), format="yuv420p")
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    return buf.getvalue()


def yuv420p(rgb: np.ndarray) -> np.ndarray:
    """RGB [H, W, 3] uint8 (even sides) as yuv420p planes stacked [H·3/2, W]: BT.601 limited
    range in integers, chroma averaged over 2×2 pixels. Done here rather than by swscale, whose
    output PyAV's shared conversion contexts can make depend on what was converted before."""
    r, g, b = (rgb[..., k].astype(np.int32) for k in range(3))
    y = ((66 * r + 129 * g + 25 * b + 128) >> 8) + 16
    u = ((-38 * r - 74 * g + 112 * b + 128) >> 8) + 128
    v = ((112 * r - 94 * g - 18 * b + 128) >> 8) + 128
    h, w = y.shape

    def half(plane: np.ndarray) -> np.ndarray:
        return (plane.reshape(h // 2, 2, w // 2, 2).sum(axis=(1, 3)) + 2) >> 2

    chroma = np.concatenate([half(u).reshape(h // 4, w), half(v).reshape(h // 4, w)])
    return np.concatenate([y, chroma]).astype(np.uint8)


def make_clip(photo: "Image.Image", clip: Clip = Clip()) -> bytes:
    return encode_clip(clip_frames(photo, clip), clip)
