"""Reject reasons: every input row that is not accepted gets exactly one of these codes.

``rejects.parquet`` holds ``source, row, reason, message``; ``preprocess.json`` counts them per
source and per reason so that input rows = accepted + rejected can be checked.
"""

from __future__ import annotations

REASONS = {
    "malformed_json": "the row is not valid JSON or not a JSON object",
    "unreadable_source": "a whole annotation file could not be parsed (counted as one row)",
    "undecodable_text": "the row has bytes that are not UTF-8 or lone surrogates",
    "missing_field": "a required field (conversations, from, value) is absent",
    "bad_field": "a field has the wrong type (e.g. image is not a string or list of strings)",
    "bad_role": "a turn's 'from' is not human/user, gpt/assistant or system",
    "no_assistant_turn": "nothing to supervise: no gpt/assistant turn",
    "image_count_mismatch": "the number of <image> placeholders differs from the number of images",
    "path_outside_root": "a relative image path leads out of its image root with '..'",
    "missing_image": "an image file or URL does not exist",
    "unreachable_image": "an image URL still failed (5xx, dropped connection, cut-off body) "
                         "after every retry",
    "empty_image": "an image file has zero bytes or a zero width/height",
    "corrupt_image": "an image header cannot be parsed",
    "truncated_image": "an image file ends before its end-of-image marker",
    "decompression_bomb": "an image has more pixels than --max-image-pixels",
        "bad_aspect_ratio": "an image is more elongated than the tiling policy allows",
    "template_error": "the model's chat template refuses the conversation or drops its text",
    "too_long": "the sample's sequence length exceeds --max-seq-len",
}


class Reject(Exception):
    """Raised by per-sample code; the job catches it and records a reject row."""

    def __init__(self, reason: str, message: str) -> None:
        assert reason in REASONS, reason
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.message = message
