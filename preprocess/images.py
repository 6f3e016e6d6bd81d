"""Header-only image inspection: size and integrity without decoding pixels.

Pillow's ``Image.open`` parses only the header, which gives the size. A file cut short still has a
valid header, so the file's tail is checked for the format's end marker as well: cheap, and it is
what catches the truncated downloads common in scraped VLM data.
"""

from __future__ import annotations

import io
import os
import posixpath
import struct
import warnings
from dataclasses import dataclass

from PIL import Image, UnidentifiedImageError

from vlmshard.io import RemoteReadError, is_url, read_bytes

from .config import DEFAULT_MAX_IMAGE_PIXELS
from .rejects import Reject

# Pillow's own default limit: larger images are treated as decompression bombs.
_TAIL_BYTES = 1024

# Oversized images become 'decompression_bomb' rejects with our own limit; Pillow's warning about
# the same thing would only flood the log (a per-call catch_warnings costs more than the check).
warnings.filterwarnings("ignore", category=Image.DecompressionBombWarning)


@dataclass(frozen=True)
class ImageHeader:
    path: str
    width: int
    height: int
    format: str


def resolve_image_path(path: str, root: str, allow_outside_root: bool = False) -> str:
    """An image reference made absolute against its source's root (URLs and absolute paths
    name their file themselves and pass through). A relative path whose ``..`` leads out of the
    root is a ``path_outside_root`` reject unless ``allow_outside_root``: data must not read
    files its root does not hold."""
    if is_url(path) or os.path.isabs(path):
        return path
    relative = posixpath.normpath(path.replace(os.sep, "/"))
    if not allow_outside_root and (relative == ".." or relative.startswith("../")):
        raise Reject("path_outside_root", f"image {path!r} leads out of the image root {root} "
                                          "(--allow-outside-image-root reads it anyway)")
    if is_url(root):
        return root.rstrip("/") + "/" + relative
    return os.path.normpath(os.path.join(root, relative))


def read_image_header(path: str, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> ImageHeader:
    """Size and format of the image at ``path`` (local or fsspec URL); raises ``Reject``."""
    try:
        # A remote image is fetched whole (with retries), then checked exactly as a local file
        # is, so both get the same reject reasons.
        opener = io.BytesIO(read_bytes(path)) if is_url(path) else open(path, "rb")
    except FileNotFoundError:
        raise Reject("missing_image", f"image not found: {path}") from None
    except RemoteReadError as e:
        raise Reject("unreachable_image", str(e)) from None
    except Exception as e:  # OSError locally; each fsspec backend raises its own kinds
        raise Reject("missing_image", f"cannot open image {path}: {e}") from None
    with opener as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        if size == 0:
            raise Reject("empty_image", f"image has zero bytes: {path}")
        f.seek(0)
        try:
            with Image.open(f) as im:
                width, height = im.size
                fmt = im.format or ""
        except Image.DecompressionBombError as e:
            raise Reject("decompression_bomb", f"{path}: {e}") from None
        except (UnidentifiedImageError, OSError, ValueError, SyntaxError, struct.error) as e:
            raise Reject("corrupt_image", f"cannot parse image header of {path}: {e}") from None
        if width <= 0 or height <= 0:
            raise Reject("empty_image", f"image {path} is {width}x{height}")
        if width * height > max_pixels:
            raise Reject("decompression_bomb",
                         f"image {path} is {width}x{height} = {width * height:,} pixels, "
                         f"over the limit of {max_pixels:,}")
        f.seek(max(0, size - _TAIL_BYTES))
        tail = f.read()
        if not _has_end_marker(fmt, tail, size, f):
            raise Reject("truncated_image", f"{fmt} image {path} ends before its end marker "
                                            f"({size} bytes): the file is cut short")
    return ImageHeader(path=path, width=width, height=height, format=fmt)


def _jpeg_reaches_eoi(f) -> bool:
    """Whether the JPEG's own structure ends in an EOI marker, whatever follows it: segments by
    their lengths, and each scan's entropy-coded data up to the next marker (0xFF not followed
    by a stuffed 0x00, a restart marker or fill)."""
    f.seek(0)
    data = f.read()
    n, i = len(data), 2  # after SOI
    while i + 1 < n:
        if data[i] != 0xFF:
            return False
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte before a marker
            i += 1
        elif marker == 0xD9:
            return True
        elif marker == 0x01 or 0xD0 <= marker <= 0xD7:  # no length
            i += 2
        else:
            if i + 4 > n:
                return False
            i += 2 + int.from_bytes(data[i + 2:i + 4], "big")
            if marker == 0xDA:  # start of scan: skip its entropy-coded data
                while True:
                    j = data.find(b"\xff", i)
                    if j < 0 or j + 1 >= n:
                        return False
                    if data[j + 1] == 0x00 or 0xD0 <= data[j + 1] <= 0xD7:
                        i = j + 2
                    else:
                        i = j
                        break
    return False


def _has_end_marker(fmt: str, tail: bytes, size: int, f) -> bool:
    """Whether the file ends the way a complete file of this format does."""
    if fmt == "JPEG":
        # 0xFF is byte-stuffed in entropy-coded data, so FFD9 near the end is the EOI marker;
        # otherwise data may follow the EOI (a Motion Photo's MP4, EXIF appended): walk the file.
        return b"\xff\xd9" in tail or _jpeg_reaches_eoi(f)
    if fmt == "PNG":
        return b"IEND" in tail[-64:]
    if fmt == "GIF":
        return tail.rstrip(b"\x00").endswith(b";")
    if fmt in ("WEBP", "BMP"):
        f.seek(0)
        head = f.read(8)
        if fmt == "WEBP":
            declared = struct.unpack("<I", head[4:8])[0] + 8
        else:
            declared = struct.unpack("<I", head[2:6])[0]
        return size >= declared
    return True  # formats without an end marker (TIFF, ...): the header check is all we have
