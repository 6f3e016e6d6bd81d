"""Reject reasons: every input row that is not accepted gets exactly one of these codes.

``rejects.parquet`` holds ``source, row, reason, message``; ``preprocess.json`` counts them per
source and per reason so that input rows = accepted + rejected can be checked. A row with several
faults gets the reason of the first check it fails; cheap checks (the row's fields, its text, the
number of images) come before reading any image.
"""

from __future__ import annotations

import re

from .errors import InputError

REASONS = {
    "malformed_json": "the row is not valid JSON or not a JSON object",
    "unreadable_source": "a whole annotation file could not be parsed (counted as one row)",
    "undecodable_text": "the row has bytes that are not UTF-8 or lone surrogates",
    "nul_in_text": "a turn's text or an image path holds a NUL character (U+0000): binary or "
                   "UTF-16 data read as text",
    "missing_field": "a required field (conversations or messages; a turn's from/role or "
                     "value/content) is absent",
    "bad_field": "a field has the wrong type or value: an image that is neither a path, a URL "
                 "nor {bytes, path}, a content item of unknown type, a turn that is not an object",
    "bad_role": "a turn's role is not human/user, gpt/assistant, system, observation/tool or "
                "function_call (or one --roles maps)",
    "no_assistant_turn": "nothing to supervise: no gpt/assistant turn, or only empty ones",
    "image_count_mismatch": "the <image> placeholders and image items differ in number from the "
                            "images",
    "too_many_images": "a row has more images than the stats table's n_images holds (32,767)",
    "path_outside_root": "a relative image path leads out of its image root with '..'",
    "missing_image": "an image file or URL does not exist, or is not a file that can be opened "
                     "(a dangling or looping symlink, a folder, a FIFO)",
    "unreachable_image": "an image URL still failed (5xx, dropped connection, cut-off body) "
                         "after every retry",
    "empty_image": "an image file has zero bytes or a zero width/height",
    "corrupt_image": "an image header cannot be parsed (a file, or embedded bytes or base64)",
    "truncated_image": "an image file ends before its end-of-image marker or the data its "
                       "header declares",
    "decompression_bomb": "an image has more pixels than --max-image-pixels",
    "bad_aspect_ratio": "an image is more elongated than the tiling policy allows",
    "video_count_mismatch": "the <video> placeholders and video items differ in number from the "
                            "videos",
    "unsupported_video": "a video for a model whose family has no video layout (Gemma 3)",
    "unsupported_audio": "a row with audio (an audios column, an <audio> placeholder or an "
                         "audio item): no family reads audio",
    "missing_video": "a video file or URL does not exist, or is not a file that can be opened",
    "unreachable_video": "a video URL still failed after every retry",
    "empty_video": "a video file has zero bytes or its video stream holds no frame",
    "corrupt_video": "a video container or stream that FFmpeg (PyAV) cannot read, or frames "
                     "of a frame-list video that differ in size",
    "truncated_video": "a video file ends before the data or frames its container declares",
    "no_video_stream": "a video file holds no video stream (audio only)",
    "unsupported_codec": "a video's codec has no decoder in FFmpeg (PyAV's build)",
    "video_too_long": "a video runs longer than --max-video-seconds",
    "template_error": "the model's chat template refuses the conversation or drops its text",
    "too_long": "the sample's sequence length exceeds --max-seq-len, or --cutoff-len cannot cut "
                "it without cutting an image or video or every answer",
}

# Rows of a kind the model does not read, rather than rows the options misread: a source of only
# these, beside sources that are accepted, is a warning, not a failed job.
UNSUPPORTED = frozenset({"unsupported_audio", "unsupported_video"})

MAX_MESSAGE = 1000  # characters: a 1 MB bad value must not make a 1 MB reject row

# Control characters and line breaks (str.splitlines breaks at all of these) shown escaped, so a
# message is always one line, whatever a bad path or value holds.
_ESCAPES = {c: f"\\x{c:02x}" for c in (*range(0x20), 0x7F, 0x85)}
_ESCAPES.update({ord("\n"): "\\n", ord("\r"): "\\r", ord("\t"): "\\t",
                 0x2028: "\\u2028", 0x2029: "\\u2029"})


# The repr of a file object a library names in its error (Pillow: "cannot identify image file
# <_io.BytesIO object at 0x7f...>"): run-specific, so a reject message must not keep it.
_FILE_OBJECT = re.compile(r"<_io\.\w+(?: name=(?:'[^'>]*'|\"[^\">]*\"|\d+))?[^<>]*>"
                          r"|<[\w.]+ object at 0x[0-9a-fA-F]+>")
_ADDRESS = re.compile(r"<([\w.]+) object at 0x[0-9a-fA-F]+>")


def error_text(error: BaseException, name: str) -> str:
    """A third-party error's text for a reject message about the item ``name`` (a path, or
    "embedded image 0"): a file object it names, with its object address, becomes ``name``, so
    two runs on the same input give the same message."""
    return _FILE_OBJECT.sub(lambda _: name, str(error))


def one_line(message: str) -> str:
    """``message`` as one bounded line of valid UTF-8: control characters and lone surrogates
    (a path read with ``surrogateescape``) escaped, cut at ``MAX_MESSAGE``; an object address
    left in it (``<X object at 0x...>``) is dropped to ``<X>``, which no run repeats."""
    message = _ADDRESS.sub(r"<\1>", message[: 4 * MAX_MESSAGE]).translate(_ESCAPES)
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    if len(message) > MAX_MESSAGE:
        message = message[: MAX_MESSAGE - 1] + "…"
    return message


class Reject(InputError):
    """Raised by per-sample code (a family's tiling rule included); preprocess catches it and
    records a reject row."""

    def __init__(self, reason: str, message: str) -> None:
        assert reason in REASONS, reason
        message = one_line(message)
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.message = message
