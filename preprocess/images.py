"""Header-only image inspection: size and integrity without decoding pixels.

Pillow's ``Image.open`` parses only the header, which gives the size. A file cut short still has a
valid header, so the file's tail is checked for the format's end marker as well (or, for formats
without one, that the file holds the data its header declares: TIFF strips, WebP's RIFF size,
AVIF's boxes): cheap, and it is what catches the truncated downloads common in scraped VLM data.

Sizes are the stored pixels' size: the EXIF orientation tag is not applied, because the loader
(``shards/records.py::decoded_images``) decodes the stored pixels without ``exif_transpose``, and
the tile count must follow the pixels the model is given. ``tests/test_bad_input.py`` checks the
two against each other for all eight orientations.
"""

from __future__ import annotations

import io
import os
import posixpath
import stat
import struct
import warnings
from dataclasses import dataclass

from PIL import Image

from vlmshard.io import RemoteReadError, is_url, read_bytes, resolve
from vlmshard.rejects import Reject, error_text

from .config import DEFAULT_MAX_IMAGE_PIXELS

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
    bytes: int  # the encoded image's size


def resolve_image_path(path: str, root: str, allow_outside_root: bool = False) -> str:
    """An image reference made absolute against its source's root. A relative path whose ``..``
    leads out of the root is a ``path_outside_root`` reject unless ``allow_outside_root``: data
    must not read files its root does not hold.

    The policy, explicitly: the check is on the path as written, before any file is touched.
    URLs and absolute paths name their file themselves and pass through; a symlink inside the
    root is followed wherever it points, as the root's owner put it there (a Hugging Face cache
    links each snapshot's files to blobs outside it)."""
    if is_url(path) or os.path.isabs(path):
        return path
    relative = posixpath.normpath(path.replace(os.sep, "/"))
    if not allow_outside_root and (relative == ".." or relative.startswith("../")):
        raise Reject("path_outside_root", f"image {path!r} leads out of the image root {root} "
                                          "(--allow-outside-image-root reads it anyway)")
    return resolve(root, relative)


def read_image_header(path: str, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
                      data: bytes | None = None) -> ImageHeader:
    """Size and format of the image at ``path`` (local or fsspec URL), or of ``data``, the bytes a
    row embeds (``path`` then only names them in messages); raises ``Reject``."""
    if data is not None:
        return _inspect(io.BytesIO(data), path, max_pixels)
    if not is_url(path):
        _check_regular_file(path)
    try:
        # A remote image is fetched whole (with retries), then checked exactly as a local file
        # is, so both get the same reject reasons.
        opener = io.BytesIO(read_bytes(path)) if is_url(path) else open(path, "rb")
    except FileNotFoundError as e:
        raise Reject("missing_image", f"image not found: {path}") from e
    except RemoteReadError as e:
        raise Reject("unreachable_image", str(e)) from e
    except OSError as e:  # a folder, a FIFO, a forbidden file or object
        raise Reject("missing_image", f"cannot open image {path}: {e}") from e
    with opener as f:
        return _inspect(f, path, max_pixels)


def _inspect(f, path: str, max_pixels: int) -> ImageHeader:
    """``read_image_header`` on an open binary file."""
    f.seek(0, os.SEEK_END)
    size = f.tell()
    if size == 0:
        raise Reject("empty_image", f"image has zero bytes: {path}")
    f.seek(0)
    try:
        with Image.open(f) as im:
            width, height = im.size
            fmt = im.format or ""
            declared = _tiff_data_end(im) if fmt == "TIFF" else 0
    except Image.DecompressionBombError as e:
        raise Reject("decompression_bomb", f"{path}: {error_text(e, path)} (raise "
                                           "--max-image-pixels to read it)") from e
    except Exception as e:  # Pillow's plugins raise many kinds on malformed headers
        if _container_cut_short(f, size):
            raise Reject("truncated_image", f"image {path} ends before the data its "
                                            f"header declares ({size} bytes): the file is "
                                            "cut short") from e
        raise Reject("corrupt_image", f"cannot parse image header of {path}: "
                                       f"{error_text(e, path)}") from e
    if width <= 0 or height <= 0:
        raise Reject("empty_image", f"image {path} is {width}x{height}")
    if width * height > max_pixels:
        raise Reject("decompression_bomb",
                     f"image {path} is {width}x{height} = {width * height:,} pixels, "
                     f"over --max-image-pixels {max_pixels:,}")
    f.seek(max(0, size - _TAIL_BYTES))
    tail = f.read()
    try:
        complete = _has_end_marker(fmt, tail, size, f) and size >= declared
    except (struct.error, ValueError):
        complete = False
    if not complete:
        what = "the data its header declares" if declared > size else "its end marker"
        raise Reject("truncated_image", f"{fmt} image {path} ends before {what} "
                                        f"({size} bytes): the file is cut short")
    return ImageHeader(path=path, width=width, height=height, format=fmt, bytes=size)


def _check_regular_file(path: str, what: str = "image") -> None:
    """Reject a local path that is not a regular file before opening it: opening a FIFO would
    block forever, a symlink loop or a folder cannot be read."""
    try:
        st = os.stat(path)
    except FileNotFoundError as e:
        raise Reject(f"missing_{what}", f"{what} not found: {path}") from e
    except (OSError, ValueError) as e:  # ELOOP, EACCES, ENAMETOOLONG; ValueError: a NUL byte
        raise Reject(f"missing_{what}",
                     f"cannot open {what} {path}: {getattr(e, 'strerror', None) or e}") from e
    if not stat.S_ISREG(st.st_mode):
        kind = ("a folder" if stat.S_ISDIR(st.st_mode) else "a FIFO" if stat.S_ISFIFO(st.st_mode)
                else "a device or socket")
        raise Reject(f"missing_{what}", f"{what} {path} is {kind}, not a file")


def _tiff_data_end(im: Image.Image) -> int:
    """Where the first frame's strips (or tiles) end, as its TIFF header declares them."""
    tags = getattr(im, "tag_v2", {})
    offsets = tags.get(273) or tags.get(324)  # StripOffsets, TileOffsets
    counts = tags.get(279) or tags.get(325)  # StripByteCounts, TileByteCounts
    if offsets is None or counts is None:
        return 0
    offsets = offsets if isinstance(offsets, tuple) else (offsets,)
    counts = counts if isinstance(counts, tuple) else (counts,)
    return max((int(o) + int(c) for o, c in zip(offsets, counts)), default=0)


def _container_cut_short(f, size: int) -> bool:
    """Whether a file that Pillow could not open is a container declaring more bytes than it
    has: WebP's RIFF size, or the boxes of an ISO-BMFF image (AVIF, HEIF)."""
    f.seek(0)
    head = f.read(12)
    if head[:4] == b"RIFF" and len(head) >= 8:
        return struct.unpack("<I", head[4:8])[0] + 8 > size
    if head[4:8] == b"ftyp":
        return _boxes_end(f, size) > size
    return False


def _boxes_end(f, size: int) -> int:
    """Where an ISO-BMFF file's top-level boxes end, by their declared sizes (size + 1 for a box
    header that is itself cut)."""
    pos = 0
    for _ in range(4096):  # a real image has a handful of top-level boxes
        if pos >= size:
            return pos
        f.seek(pos)
        header = f.read(16)
        if len(header) < 8:
            return size + 1
        n = int.from_bytes(header[:4], "big")
        if n == 1:  # 64-bit size follows the type
            if len(header) < 16:
                return size + 1
            n = int.from_bytes(header[8:16], "big")
        elif n == 0:  # the box runs to the end of the file
            return size
        if n < 8:
            return 0  # malformed, not cut short
        pos += n
    return pos


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
    if fmt in ("JPEG", "MPO"):  # MPO: a camera's JPEG with more images after the first
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
    if fmt in ("AVIF", "HEIF"):
        return _boxes_end(f, size) <= size
    return True  # formats without an end marker (TIFF: its strips are checked by the caller)
