"""Video containers with PyAV: probe without decoding, decode only the sampled frames.

PyAV (``av``) wraps the FFmpeg libraries its wheel ships, so a CPU fleet's nodes read every
common container and codec with nothing else installed (``docs/video.md``). Preprocessing counts
a video from its container alone: the stream's size, frame rate and the packets the demuxer
returns (no frame is decoded but the first, which proves the codec decodes): cheap, and exact for
MKV/WebM too, whose headers hold no frame count. The writer decodes the file once more and keeps
only the sampled frames (``sampled_frames``), in presentation order, as the family's rule picked
them by index.

Frame sizes are the coded size, as the decoder returns frames: a rotation tag is not applied, as
an image's EXIF orientation is not (``preprocess/images.py``).
"""

from __future__ import annotations

import io
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator

from vlmshard.io import RemoteReadError, is_url, read_bytes
from vlmshard.rejects import Reject

from .images import _check_regular_file, _container_cut_short

if TYPE_CHECKING:
    from PIL import Image

logging.getLogger("libav").setLevel(logging.ERROR)  # FFmpeg's own chatter on malformed input

# FFmpeg's demuxers of single images: such a file is a still, not a video (GIF, animated, is read)
STILL_FORMATS = {"image2", "jpeg_pipe", "png_pipe", "webp_pipe", "bmp_pipe", "tiff_pipe",
                 "jpegxl_pipe", "qoi_pipe", "pam_pipe", "ppm_pipe", "pgm_pipe", "svg_pipe"}
# A container stating no frame count (MKV, WebM) is cut short when its frames fall this far below
# its duration × rate (its audio may run a little longer than its video)
SHORT_OF_DURATION = 0.9


@dataclass(frozen=True)
class VideoHeader:
    path: str
    width: int
    height: int
    frames: int  # the video stream's frames (packets with data)
    fps: float  # average frame rate
    duration: float  # seconds: frames / fps
    codec: str
    bytes: int


def video_bytes(path: str, data: bytes | None, what: str = "video") -> bytes:
    """A video file's bytes (``data`` when the row embeds them); raises ``Reject``."""
    if data is not None:
        return data
    try:
        if is_url(path):
            return read_bytes(path)
        _check_regular_file(path, what)
        with open(path, "rb") as f:
            return f.read()
    except RemoteReadError as e:
        raise Reject(f"unreachable_{what}", str(e)) from e
    except FileNotFoundError as e:
        raise Reject(f"missing_{what}", f"{what} not found: {path}") from e
    except OSError as e:
        raise Reject(f"missing_{what}", f"cannot open {what} {path}: {e}") from e


def read_video_header(path: str, data: bytes | None = None,
                      max_seconds: float | None = None) -> VideoHeader:
    """Size, frame rate and frame count of the video at ``path`` (or of ``data``, the bytes a row
    embeds); raises ``Reject`` for a file that is missing, corrupt, cut short, holds no video
    frame, uses a codec FFmpeg cannot decode, or runs longer than ``max_seconds``."""
    data = video_bytes(path, data)
    if not data:
        raise Reject("empty_video", f"video has zero bytes: {path}")
    with _open(data, path) as container:
        stream = _video_stream(container)
        if stream is None:
            raise Reject("no_video_stream", f"{path} holds no video stream (streams: "
                                            f"{_stream_kinds(container)})")
        if container.format.name in STILL_FORMATS:
            raise Reject("no_video_stream", f"{path} is a still image "
                                            f"({container.format.name}), not a video")
        if stream.codec_context is None:
            raise Reject("unsupported_codec", f"{path}: FFmpeg has no decoder for its video "
                                              "codec")
        rate = stream.average_rate or stream.guessed_rate
        if not rate or rate <= 0:
            raise Reject("corrupt_video", f"{path}: its video stream states no frame rate")
        fps = float(rate)
        declared = stream.frames  # 0 where the container does not state it (MKV, WebM)
        stated = (float(stream.duration * stream.time_base) if stream.duration
                  else (container.duration or 0) / 1e6)
        if max_seconds is not None and stated > max_seconds:
            raise Reject("video_too_long", f"{path} runs {stated:.1f} s, over "
                                           f"--max-video-seconds {max_seconds:g}")
        width, height = stream.codec_context.width, stream.codec_context.height
        codec = stream.codec_context.name
        shown: list[bool] = []  # per packet with data: whether a decoder shows it
        decoded = False  # the first frame, decoded in the same pass: it proves the codec
        try:
            for packet in container.demux(stream):
                if packet.size:  # an edit list's discarded packets (a trimmed copy): no frame
                    shown.append(not packet.is_discard)
                if not decoded:  # the last, empty packet flushes a decoder that holds frames
                    decoded = bool(packet.decode())
        except Exception as e:  # av.FFmpegError subclasses: the data stops making sense
            raise _broken(data, path, f"its packets stop parsing or decoding: {e}", e) from e
    frames = sum(shown)
    if frames == 0:
        raise Reject("empty_video", f"{path} holds no video frame")
    if declared and len(shown) < declared:
        raise Reject("truncated_video", f"{path}: its header declares {declared} frames, the "
                                        f"file holds {len(shown)}: the file is cut short")
    if not declared and stated and len(shown) < SHORT_OF_DURATION * stated * fps - 2:
        raise Reject("truncated_video", f"{path}: it states {stated:.2f} s at {fps:g} fps, the "
                                        f"file holds {len(shown)} frames: the file is cut short")
    if width <= 0 or height <= 0:
        raise Reject("corrupt_video", f"{path}: its frames are {width}x{height}")
    if max_seconds is not None and frames / fps > max_seconds:
        raise Reject("video_too_long", f"{path} runs {frames / fps:.1f} s ({frames} frames at "
                                       f"{fps:g} fps), over --max-video-seconds {max_seconds:g}")
    if not decoded:
        raise Reject("corrupt_video", f"{path}: its first frame does not decode")
    return VideoHeader(path=path, width=width, height=height, frames=frames, fps=fps,
                       duration=frames / fps, codec=codec, bytes=len(data))


def sampled_frames(data: bytes, indices: list[int], path: str) -> Iterator["Image.Image"]:
    """The frames at ``indices`` (ascending; repeats allowed) as RGB ``PIL`` images, decoding the
    stream in order up to the last; raises ``Reject`` where the stream does not decode."""
    wanted = sorted(set(indices))
    if not wanted:
        return
    with _open(data, path) as container:
        stream = _video_stream(container)
        stream.thread_type = "AUTO"
        k = 0
        try:
            for index, frame in enumerate(container.decode(stream)):
                if index == wanted[k]:
                    image = frame.to_image()  # RGB24, as transformers' PyAV reader asks for
                    for _ in range(indices.count(index)):
                        yield image
                    k += 1
                    if k == len(wanted):
                        return
        except Reject:
            raise
        except Exception as e:  # av.FFmpegError subclasses
            raise _broken(data, path, f"frame {wanted[k]} does not decode: {e}", e) from e
    raise Reject("truncated_video", f"{path} ends before frame {wanted[k]}: the file is cut "
                                    "short or its frame count changed")


class _open:
    """``av.open`` on bytes as a context manager whose failures are ``Reject``s."""

    def __init__(self, data: bytes, path: str) -> None:
        self.data, self.path = data, path

    def __enter__(self):
        import av

        try:
            self.container = av.open(io.BytesIO(self.data), metadata_errors="ignore")
        except av.FFmpegError as e:
            raise _broken(self.data, self.path, f"not a readable video container: {e}",
                          e) from e
        return self.container

    def __exit__(self, *exc) -> None:
        self.container.close()


def _broken(data: bytes, path: str, what: str, error: Exception) -> Reject:
    """The reject for a container or stream PyAV cannot read: cut short, a codec it has no
    decoder for, or corrupt."""
    import av

    if _container_cut_short(io.BytesIO(data), len(data)):
        return Reject("truncated_video", f"video {path} ends before the data its container "
                                         f"declares ({len(data)} bytes): the file is cut short")
    if isinstance(error, av.DecoderNotFoundError):
        return Reject("unsupported_codec", f"video {path}: no decoder for its codec: {error}")
    return Reject("corrupt_video", f"video {path}: {what}")


def _video_stream(container):
    """The container's first video stream that is not cover art (an attached picture), or
    None."""
    import av

    cover = av.stream.Disposition.attached_pic
    return next((s for s in container.streams.video if not s.disposition & cover), None)


def _stream_kinds(container) -> str:
    return ", ".join(s.type for s in container.streams) or "none"
