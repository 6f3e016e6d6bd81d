"""LLaMA-Factory's ``cutoff_len``: a sample longer than N tokens is cut as its supervised
processor cuts it (``data/processor/supervised.py``, ``infer_seqlen`` in ``processor_utils.py``),
except that an image's or video's tokens are never cut or dropped.

The sample is read as LLaMA-Factory's template encodes it: pairs of a prompt (what is not
supervised, from the end of the previous answer) and an answer (a supervised run). Pairs are taken
in order while room is left; each gets ``infer_seqlen``'s split of the room between its prompt and
answer, and keeps the beginning of each. A prompt keeps at least up to the end of its last image
or video, the answer giving up the difference. A sample whose media do not fit, or that would
keep nothing to supervise, is a ``too_long`` reject.
"""

from __future__ import annotations

from vlmshard.rejects import Reject

from .tokenize import IGNORE_INDEX


def infer_seqlen(source_len: int, target_len: int, cutoff_len: int) -> tuple[int, int]:
    """LLaMA-Factory's split of ``cutoff_len`` between a prompt and its answer: a short answer
    is kept whole, else a short prompt, else both shrink in proportion."""
    if target_len * 2 < cutoff_len:
        max_target_len = cutoff_len
    elif source_len * 2 < cutoff_len:
        max_target_len = cutoff_len - source_len
    else:
        max_target_len = int(cutoff_len * (target_len / (source_len + target_len)))
    new_target_len = min(max_target_len, target_len)
    new_source_len = min(max(cutoff_len - new_target_len, 0), source_len)
    return new_source_len, new_target_len


def _pairs(labels: list[int]) -> list[tuple[int, int, int]]:
    """(prompt start, answer start, answer end) of each prompt and the answer after it; the
    last prompt may have no answer."""
    pairs, start, k, n = [], 0, 0, len(labels)
    while k < n:
        while k < n and labels[k] == IGNORE_INDEX:
            k += 1
        middle = k
        while k < n and labels[k] != IGNORE_INDEX:
            k += 1
        pairs.append((start, middle, k))
        start = k
    return pairs


def cut(ids: list[int], labels: list[int], media_ids: frozenset[int], cutoff_len: int
        ) -> tuple[list[int], list[int]]:
    """``ids`` and ``labels`` cut to at most ``cutoff_len`` tokens (unchanged when they fit);
    raises ``Reject``."""
    if len(ids) <= cutoff_len:
        return ids, labels
    kept_ids: list[int] = []
    kept_labels: list[int] = []
    total = 0
    for k, (start, middle, end) in enumerate(_pairs(labels)):
        media_end = max((i + 1 for i in range(start, middle) if ids[i] in media_ids),
                        default=start)
        if total >= cutoff_len:
            if media_end > start:
                raise Reject("too_long", f"--cutoff-len {cutoff_len} drops prompt {k + 1} and "
                                         "its images or videos; raise it")
            break
        source, target = infer_seqlen(middle - start, end - middle, cutoff_len - total)
        if media_end - start > source:  # the media stay whole: the answer gives way
            target -= media_end - start - source
            source = media_end - start
            if target < 0:
                media = sum(i in media_ids for i in ids)
                raise Reject("too_long", f"--cutoff-len {cutoff_len} cannot hold prompt {k + 1} "
                                         f"up to its last image or video ({media} image and "
                                         "video tokens in all); raise it")
        kept_ids += ids[start:start + source] + ids[middle:middle + target]
        kept_labels += labels[start:start + source] + labels[middle:middle + target]
        total += source + target
    if all(label == IGNORE_INDEX for label in kept_labels):
        raise Reject("too_long", f"--cutoff-len {cutoff_len} keeps nothing of the answers")
    return kept_ids, kept_labels
