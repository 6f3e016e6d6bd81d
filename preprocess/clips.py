"""Short video clips made from a still photo (pans and zooms), encoded offline with PyAV: the
demo's videos and the tests'. Same arguments, same bytes (x264 and the muxers in bit-exact mode).
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
        stream = container.add_stream(CODECS[clip.container], rate=round(clip.fps))
        stream.width, stream.height, stream.pix_fmt = clip.width, clip.height, "yuv420p"
        stream.codec_context.flags |= av.codec.context.Flags.bitexact
        stream.thread_count = 1
        for image in frames:
            frame = av.VideoFrame.from_ndarray(np.asarray(image), format="rgb24")
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    return buf.getvalue()


def make_clip(photo: "Image.Image", clip: Clip = Clip()) -> bytes:
    return encode_clip(clip_frames(photo, clip), clip)
