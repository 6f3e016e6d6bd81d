"""A worker's memory is bounded by its part, not by its source.

Parquet parts decode only the row groups holding their rows; JSON lists are indexed once by the
planner and each part parses only its own rows' bytes. Every test checks the rows against an
independent whole-file read (``pyarrow.parquet.read_table``, ``json.load``) and measures memory
or bytes read honestly: pyarrow's allocator peak in a fresh process, ``tracemalloc``, and the
kernel's count of bytes read (``/proc/self/io``).
"""

from __future__ import annotations

import json
import logging
import os
import random
import subprocess
import sys
import textwrap
import tracemalloc

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from vlmshard.preprocess.sources import (
    Part,
    Source,
    index_source,
    plan_parts,
    read_part_rows,
)
from vlmshard.rejects import Reject

log = logging.getLogger(__name__)

TRICKY = ['"', "\\", "]", "}", ",", "[", "{", ":", '\\"',
          "é", "漢字", "🎉", "\n", "\t", " ", "a"]


def _text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(TRICKY) if rng.random() < 0.3 else "x" for _ in range(n))


def _source(path, kind: str) -> Source:
    return Source(name="s", kind=kind, path=str(path), image_root=str(path.parent))


def _read(source: Source, rows) -> list:
    part = Part(index=0, source_index=0, rows=np.asarray(rows, np.int64))
    return list(read_part_rows(source, part))


# ---------------------------------------------------------------------------------------------
# Parquet

N_PARQUET = 4000


@pytest.fixture(scope="module")
def parquet_file(tmp_path_factory):
    rng = np.random.default_rng(0)
    table = pa.table({
        "id": np.arange(N_PARQUET),
        # Random letters, so the decoded size is about what the file stores.
        "text": ["".join(chr(c) for c in rng.integers(97, 123, 2000)) for _ in range(N_PARQUET)],
        "conversations": [[{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": "a"}]
                          for i in range(N_PARQUET)],
    })
    path = tmp_path_factory.mktemp("pq") / "big.parquet"
    pq.write_table(table, path, row_group_size=100)
    return path


def _arrow_peak(path, rows) -> int:
    """Peak bytes pyarrow's allocator held while reading ``rows`` (all rows: None), measured
    in a fresh process so nothing read before counts."""
    read = ("list(read_part_rows(Source('s', 'parquet', path, '.'), "
            f"Part(0, 0, np.array({list(rows)}, np.int64))))" if rows is not None
            else "pq.read_table(path).to_pylist()")
    script = textwrap.dedent(f"""
        import numpy as np, pyarrow as pa, pyarrow.parquet as pq
        from vlmshard.preprocess.sources import Part, Source, read_part_rows
        path = {str(path)!r}
        {read}
        print(pa.default_memory_pool().max_memory())
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True)
    return int(out.stdout.split()[-1])


def test_parquet_part_decodes_only_its_row_groups(parquet_file):
    whole = pq.read_table(parquet_file)
    assert pq.ParquetFile(parquet_file).metadata.num_row_groups == N_PARQUET // 100
    rows = range(1234, 1500)  # cuts across row groups at both ends
    got = _read(_source(parquet_file, "parquet"), rows)
    assert got == list(zip(rows, whole.slice(1234, 266).to_pylist()))

    unit_peak = _arrow_peak(parquet_file, rows)
    whole_peak = _arrow_peak(parquet_file, None)
    log.info("parquet: decoded table %d B; arrow peak reading 266 rows %d B, the whole table %d B",
             whole.nbytes, unit_peak, whole_peak)
    assert whole_peak >= whole.nbytes  # the measure sees a whole read
    assert unit_peak < whole.nbytes / 5


def test_parquet_part_that_wraps_and_skips_keeps_its_order(parquet_file):
    """Rows as repeat_time makes them: the end of one repeat then the start of the next, and a
    sparse subsample; the same row twice in one part."""
    whole = pq.read_table(parquet_file)
    rows = [3990, 3999, 0, 1, 99, 100, 2500, 2501, 3999]
    assert _read(_source(parquet_file, "parquet"), rows) == list(
        zip(rows, whole.take(rows).to_pylist()))


# ---------------------------------------------------------------------------------------------
# JSON list

N_JSON = 6000


@pytest.fixture(scope="module")
def json_list(tmp_path_factory):
    rng = random.Random(0)
    texts = [_text(rng, 3000) for _ in range(100)]
    rows = [{"id": i, "text": f"{i}{rng.choice(texts)}", "conversations": [
        {"from": "human", "value": _text(rng, 20)}, {"from": "gpt", "value": "]},\"\\"}],
        "meta": {"nested": [[], {}, [1.5, None, True]], "empty": ""}} for i in range(N_JSON)]
    # One row longer than the indexer's window (1 MiB), of one-byte characters.
    rows[4321]["text"] = 'é]},\\"x' * 200_000
    path = tmp_path_factory.mktemp("json") / "big.json"
    elements = (json.dumps(row, ensure_ascii=i % 2 == 0) for i, row in enumerate(rows))
    path.write_text(" \n[\n" + " ,\n\t".join(elements) + "\r\n]\n", encoding="utf-8")
    return path


def _bytes_read() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


def test_json_list_is_indexed_once_in_bounded_memory(json_list):
    size = os.path.getsize(json_list)
    tracemalloc.start()
    try:
        index = index_source(_source(json_list, "json"))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    log.info("json index: file %d B, tracemalloc peak %d B", size, peak)
    assert index.unreadable is None and index.n_rows == N_JSON
    assert peak < size / 3
    with open(json_list, "rb") as f:
        data = f.read()
    assert all(data[o:o + 1] == b"{" and data[o + n - 1:o + n] == b"}"
               for o, n in zip(index.offsets, index.lengths))


def test_json_list_parts_read_their_own_rows_only(json_list):
    source = _source(json_list, "json")
    size = os.path.getsize(json_list)
    with open(json_list, encoding="utf-8") as f:
        truth = json.load(f)
    parts = plan_parts([source], [index_source(source)], part_size=500, seed=0)
    assert len(parts) == N_JSON // 500
    peaks, reads = [], []
    for part in parts:
        before = _bytes_read()
        tracemalloc.start()
        try:  # rows checked as they come, not kept: the peak is what reading them takes
            matches = [(row, record) == (r, truth[r])
                       for (row, record), r in zip(read_part_rows(source, part), part.rows)]
            peaks.append(tracemalloc.get_traced_memory()[1])
        finally:
            tracemalloc.stop()
        reads.append(_bytes_read() - before)
        assert len(matches) == len(part.rows) and all(matches)
    log.info("json parts: file %d B; bytes read per part %d..%d, tracemalloc peak %d..%d B",
             size, min(reads), max(reads), min(peaks), max(peaks))
    # Together the parts read the file about once: no worker indexes or loads it again.
    assert sum(reads) < 1.2 * size
    # One part holds the row longer than the window; the others stay far below the file.
    assert sorted(reads)[-2] < size / 8 and sorted(peaks)[-2] < size / 8


def test_json_list_rows_of_a_part_without_spans(json_list):
    """A part not made by the planner (re-tokenizing a few rows) is read through an index built
    once in the process."""
    with open(json_list, encoding="utf-8") as f:
        truth = json.load(f)
    rows = [5999, 0, 4321, 17, 17]
    assert _read(_source(json_list, "json"), rows) == [(r, truth[r]) for r in rows]


@pytest.mark.parametrize("corrupt", [
    lambda text: text.replace('"id": 4000', '"id": tru', 1),  # past the first window
    lambda text: text.replace('"id": 5000,', '"id": 5000', 1),
    lambda text: text[:-200],  # cut short
    lambda text: text + " ]",
], ids=["bad-value", "missing-comma", "truncated", "extra-data"])
def test_malformed_json_list_is_one_clear_reject(tmp_path, corrupt):
    rows = [{"id": i, "text": "é]},\\\"" * 50} for i in range(6000)]
    text = corrupt(json.dumps(rows, indent=1, ensure_ascii=False))
    path = tmp_path / "bad.json"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(json.JSONDecodeError) as expected:
        json.loads(text)
    source = _source(path, "json")
    index = index_source(source)
    assert index.unreadable == f"{path} is not valid JSON: {expected.value}"
    (part,) = plan_parts([source], [index], part_size=100, seed=0)
    ((row, reject),) = read_part_rows(source, part)
    assert row == 0 and isinstance(reject, Reject)
    assert (reject.reason, reject.message) == ("unreadable_source", index.unreadable)
