"""Rows of text files: a JSONL file (a row per non-blank line) and a JSON list (a row per
element). Indexing finds each row's byte span in one pass that never holds the whole file; reading
parses each row from its own bytes, so a bad row is that row's reject, not the file's.
"""

from __future__ import annotations

import codecs
import json
import os
import re
from array import array
from collections.abc import Iterator
from typing import Any

import numpy as np

from vlmshard.io import is_url, open_file
from vlmshard.rejects import Reject

from .containers import Part


def jsonl_line_index(path: str) -> tuple[np.ndarray, np.ndarray]:
    """Byte offset and length of every non-blank line. Local files are memory-mapped, so a
    file far larger than RAM is scanned without being read into the driver's memory."""
    import mmap

    with open_file(path) as f:
        if is_url(path):
            data = f.read()
        else:
            size = os.fstat(f.fileno()).st_size
            data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
        offsets, lengths = array("q"), array("q")
        find, end, pos = data.find, len(data), 0
        while pos < end:
            nl = find(b"\n", pos)
            nl = end if nl < 0 else nl
            # Blank lines are not rows; only lines starting with whitespace need a closer look.
            if nl > pos and (data[pos] not in b" \t\r" or data[pos:nl].strip()):
                offsets.append(pos)
                lengths.append(nl - pos)
            pos = nl + 1
        if isinstance(data, mmap.mmap):
            data.close()
    return np.frombuffer(offsets, np.int64), np.frombuffer(lengths, np.int64)


_WINDOW = 1 << 20  # bytes of a JSON list held while indexing it; also the most one read spans
_GAP = 64 << 10  # rows further apart than this are read separately, not with the bytes between
_WHITESPACE = re.compile(r"[ \t\n\r]*")  # JSON's whitespace
_SCALAR_END = re.compile(r"[ \t\n\r,\]}]")
# Strings (group 1 is the closing quote, empty when the text ends first) and brackets. The
# quantifiers are possessive: a backtracking one keeps state for every escape of a long string.
_STRUCTURE = re.compile(r'"[^"\\]*+(?:\\.[^"\\]*+)*+("?)|[][{}]', re.DOTALL)


def json_list_index(path: str) -> tuple[np.ndarray, np.ndarray]:
    """Byte offset and length of every element of a JSON-list file, found in one streaming pass
    that parses each element (so a malformed file is rejected here, whole, as ``json.loads``
    would) while holding only a window of the file, never all of it."""
    offsets, lengths = array("q"), array("q")
    with open_file(path) as f:
        window = _JsonWindow(f, path)
        if f.read(len(codecs.BOM_UTF8)) == codecs.BOM_UTF8:
            raise window.error("Unexpected UTF-8 BOM (decode using utf-8-sig)", 0)
        f.seek(0)
        char, pos = window.next_char(0)
        if char != "[":
            value, end = window.value(pos)
            window.expect_end(end)
            raise Reject("unreadable_source",
                         f"{path} holds a JSON {type(value).__name__}, not a list")
        char, pos = window.next_char(pos + 1)
        while char != "]":
            end = window.value(pos)[1]
            offsets.append(pos)
            lengths.append(end - pos)
            char, pos = window.next_char(end)
            if char == ",":
                pos = window.next_char(pos + 1)[1]
            elif char != "]":
                raise window.error("Expecting ',' delimiter", pos)
        window.expect_end(pos + 1)
    return np.frombuffer(offsets, np.int64), np.frombuffer(lengths, np.int64)


class _JsonWindow:
    """A sliding window over a JSON file, addressed by absolute byte position.

    The bytes are decoded as Latin-1, one character per byte, so string positions are byte
    offsets; JSON's structure is ASCII and any byte may sit inside a string, so the window parses
    exactly as the UTF-8 text does.
    """

    def __init__(self, f, path: str) -> None:
        self.f, self.path = f, path
        self.text, self.base, self.eof = "", 0, False
        self.decoder = json.JSONDecoder()

    def _more(self, keep: int) -> bool:
        """Drop the text before ``keep`` and read on (at least doubling what is kept, so a long
        value is parsed a bounded number of times); False at the end of the file."""
        if self.eof:
            return False
        tail = self.text[keep - self.base:]
        data = self.f.read(max(_WINDOW, len(tail)))
        if not data:
            self.eof = True
            return False
        text = data.decode("latin-1")
        del data  # the bytes, and the old window below, freed before the new window is built
        self.text = ""
        self.text, self.base = tail + text, keep
        return True

    def next_char(self, pos: int) -> tuple[str, int]:
        """The first non-whitespace character at or after ``pos`` and its position ('' at EOF)."""
        while True:
            i = _WHITESPACE.match(self.text, pos - self.base).end()
            if i < len(self.text):
                return self.text[i], self.base + i
            pos = self.base + i
            if not self._more(pos):
                return "", pos

    def value(self, pos: int) -> tuple[Any, int]:
        """The JSON value starting at ``pos`` and where it ends, read on until it is whole."""
        while True:
            i = pos - self.base
            try:
                value, end = self.decoder.raw_decode(self.text, i)
            except json.JSONDecodeError as e:
                error = e.msg, self.base + e.pos  # not the exception: it holds the whole window
            else:
                # A number cut by the window parses short ("12" of "123"): make sure it ended.
                if (self.text[end - 1] in '"]}' or _SCALAR_END.search(self.text, end)
                        or not self._more(pos)):
                    return value, self.base + end
                continue
            # An error inside a value that ends in the window is real; else read on.
            if _ends_within(self.text, i) or not self._more(pos):
                raise self.error(*error)

    def expect_end(self, pos: int) -> None:
        """Nothing but whitespace may follow the top-level value."""
        char, pos = self.next_char(pos)
        if char:
            raise self.error("Extra data", pos)

    def error(self, message: str, pos: int) -> Reject:
        return Reject("unreadable_source",
                      f"{self.path} is not valid JSON: {message}: {_json_position(self.path, pos)}")


def _ends_within(text: str, i: int) -> bool:
    """Whether the value starting at ``text[i]`` ends inside ``text``, judged by its brackets and
    strings alone: for a valid value this is exact, so a parse error there is not a cut."""
    if i >= len(text):
        return False
    if text[i] not in '[{"':
        return _SCALAR_END.search(text, i) is not None
    depth = 0
    for m in _STRUCTURE.finditer(text, i):
        token = text[m.start()]
        if token == '"':
            if not m.group(1):
                return False
        elif token in "[{":
            depth += 1
        else:
            depth -= 1
        if depth <= 0:
            return True
    return False


def _json_position(path: str, pos: int) -> str:
    """``line L column C (char N)`` of byte ``pos``, counted in the decoded text as ``json``'s
    own messages count it; the file is read again up to ``pos``, only when there is an error."""
    decoder = codecs.getincrementaldecoder("utf-8")("surrogateescape")
    chars = lines = line_start = 0
    with open_file(path) as f:
        left = pos
        while left > 0:
            data = f.read(min(left, _WINDOW))
            if not data:
                break
            left -= len(data)
            text = decoder.decode(data, final=left <= 0)
            newline = text.rfind("\n")
            if newline >= 0:
                lines += text.count("\n")
                line_start = chars + newline + 1
            chars += len(text)
    return f"line {lines + 1} column {chars - line_start + 1} (char {chars})"


def text_rows(path: str, part: Part, errors: str) -> Iterator[tuple[int, dict | Reject]]:
    """Each row parsed from its own bytes, read in runs of nearby rows (see ``_runs``)."""
    with open_file(path) as f:
        for run in _runs(part.offsets, part.lengths):
            lo = int(part.offsets[run.start])
            f.seek(lo)
            span = memoryview(f.read(int(part.offsets[run.stop - 1] + part.lengths[run.stop - 1])
                                     - lo))
            for row, off, n in zip(part.rows[run], part.offsets[run], part.lengths[run]):
                data = span[off - lo: off - lo + n]
                if off == 0 and data[:3] == codecs.BOM_UTF8:  # a UTF-8 file's byte-order mark
                    data = data[3:]
                if bytes(data).count(0) * 4 >= len(data) > 0:  # ASCII as UTF-16: NUL between
                    yield int(row), Reject("undecodable_text", "line looks like UTF-16 (NUL "
                                                               "bytes between characters), not "
                                                               "UTF-8")
                    continue
                try:
                    text = str(data, "utf-8", errors)
                except UnicodeDecodeError as e:
                    yield int(row), Reject("undecodable_text", f"line is not UTF-8: {e}")
                    continue
                try:
                    yield int(row), as_record(json.loads(text))
                except (json.JSONDecodeError, RecursionError) as e:  # "[" * 10**5 recurses
                    yield int(row), Reject("malformed_json", f"invalid JSON: {e}")


def _runs(offsets: np.ndarray, lengths: np.ndarray) -> list[slice]:
    """Consecutive rows of a part, grouped so each group is one read: a group ends where the
    next row lies before it (a new repeat), more than ``_GAP`` bytes after it (a subsample), or
    past ``_WINDOW`` bytes from the group's start. So a part that wraps into the next repeat, or
    a sparse subsample, never reads the bytes between its rows."""
    runs, first = [], 0
    for i in range(1, len(offsets)):
        prev_end = offsets[i - 1] + lengths[i - 1]
        if (not 0 <= offsets[i] - prev_end <= _GAP
                or offsets[i] + lengths[i] - offsets[first] > _WINDOW):
            runs.append(slice(first, i))
            first = i
    runs.append(slice(first, len(offsets)))
    return runs


def as_record(value: Any) -> dict | Reject:
    if isinstance(value, dict):
        return value
    return Reject("malformed_json", f"row is a {type(value).__name__}, not a JSON object")
