"""Read what the packer needs from the stats table, or from OmniBal's length files.

Accepted inputs:

- the preprocess output folder (``OUT`` with ``stats/part-*.parquet``), its ``stats/`` folder, or
  one Parquet file of Contract 1 (``docs/design.md``);
- an OmniBal length file: a JSON list of ``{"vit_num", "token_num", ...}``;
- an OmniBal meta file: ``{name: {"token_lengths": path, ...}, ...}``. ``sample_id`` follows the
  order of the names in the file, then the rows of each length file (OmniBal's own order).
  Relative paths are resolved against the meta file's folder, then the working directory.
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
from dataclasses import dataclass

import numpy as np

from vlmshard.errors import InputError
from vlmshard.families import DEMO_FAMILY, policy_from_dict
from vlmshard.io import sha256_file

from .batches import Lengths, MediaUnits, in_token_order

log = logging.getLogger(__name__)


class StatsError(InputError):
    """The stats input cannot be read; the message names the file and what is wrong."""


@dataclass(frozen=True)
class LoadedStats:
    lengths: Lengths
    path: str
    format: str  # "vlmshard" or "omnibal"
    files: tuple[str, ...]
    sha256: str  # over the input files' names and contents, in order
    preprocess: dict | None = None  # the preprocess.json beside the stats, if any

    @property
    def family(self) -> str:
        """The model family the stats were preprocessed for, whose ViT unit ``vit_tiles``
        counts (OmniBal lengths count InternVL tiles, the demo's family)."""
        return self.preprocess["config"]["model"]["family"] if self.preprocess else DEMO_FAMILY

    @property
    def model_folder(self) -> str | None:
        """The model folder the stats were preprocessed for (None: the demo tokenizer)."""
        model = (self.preprocess or {}).get("config", {}).get("model") or {}
        return model.get("path")

    @property
    def unit_px(self) -> int | None:
        """The side in pixels of the ViT unit ``vit_tiles`` counts, as the recorded tiling
        policy states it (None: not recorded, as for OmniBal lengths)."""
        tiling = (self.preprocess or {}).get("config", {}).get("tiling")
        return policy_from_dict(tiling).tile_size if tiling else None

    def describe(self) -> dict:
        """What the stats are, not where: file names relative to the stats folder (the plan's
        run facts record the folder)."""
        root = self.path if os.path.isdir(self.path) else os.path.dirname(self.path)
        return {"format": self.format, "files": [os.path.relpath(f, root) for f in self.files],
                "sha256": self.sha256, "samples": len(self.lengths),
                "sources": list(self.lengths.sources)}


def load_stats(path: str) -> LoadedStats:
    if not os.path.exists(path):
        raise StatsError(f"{path}: no such file or folder")
    preprocess = None
    if os.path.isdir(path) or path.endswith(".parquet"):
        lengths, files = _read_parquet_stats(path), stats_files(path)
        fmt = "vlmshard"
        preprocess = read_preprocess_json(path)
    else:
        lengths, files = _read_omnibal(path)
        fmt = "omnibal"
    if len(lengths) == 0:
        raise StatsError(f"{path}: no samples to pack")
    return LoadedStats(lengths, path, fmt, tuple(files), files_sha256(files), preprocess)


def read_preprocess_json(stats: str) -> dict | None:
    """The ``preprocess.json`` of a stats path: in the output folder the stats are in or under
    (a stats folder, its ``stats/``, or one of its Parquet files)."""
    folder = os.path.abspath(stats.rstrip("/"))
    folder = folder if os.path.isdir(folder) else os.path.dirname(folder)
    for candidate in (folder, os.path.dirname(folder)):
        path = os.path.join(candidate, "preprocess.json")
        if os.path.isfile(path):
            return _read_json(path)
    return None


def files_sha256(files: list[str]) -> str:
    """One digest over the input files' names and contents, in order (recorded in the plan)."""
    digest = hashlib.sha256()
    for f in files:
        digest.update(f"{os.path.basename(f)}:{sha256_file(f)}\n".encode())
    return digest.hexdigest()


def stats_files(path: str) -> list[str]:
    """The stats Parquet files of a preprocess output folder, its stats/ folder or one file."""
    if os.path.isfile(path):
        return [path]
    folder = os.path.join(path, "stats") if os.path.isdir(os.path.join(path, "stats")) else path
    files = sorted(glob.glob(os.path.join(folder, "part-*.parquet")))
    rejects = os.path.join(path, "rejects.parquet")
    if not files and os.path.exists(rejects):
        import pyarrow.parquet as pq

        rejected = pq.ParquetFile(rejects).metadata.num_rows
        if not rejected:
            raise StatsError(f"{path} holds no samples: its preprocess read no rows (empty "
                             f"inputs) and accepted nothing")
        raise StatsError(f"{path} holds no accepted samples: all {rejected} row(s) were "
                         f"rejected; see {rejects} for why")
    if not files:
        raise StatsError(f"{path}: no stats/part-*.parquet here; give the preprocess output "
                         f"folder, its stats/ folder, a .parquet file or OmniBal .json lengths")
    return files


def _read_parquet_stats(path: str) -> Lengths:
    import pyarrow as pa
    import pyarrow.parquet as pq

    columns = ["sample_id", "source", "vit_tiles", "seq_len", "image_tiles", "videos",
               "loss_tokens"]
    try:
        table = pa.concat_tables(pq.read_table(f, columns=columns) for f in stats_files(path))
    except (pa.ArrowInvalid, KeyError) as e:
        raise StatsError(f"{path}: not a vlmshard stats table ({e})") from e
    sample_id = table["sample_id"].to_numpy()
    if not np.array_equal(sample_id, np.arange(len(sample_id))):
        raise StatsError(f"{path}: sample_id is not dense 0..N-1 in file order")
    source = table["source"].combine_chunks().dictionary_encode()
    largest, unit_squares = _units(table)
    return Lengths(table["vit_tiles"].to_numpy().astype(np.int64),
                   table["seq_len"].to_numpy().astype(np.int64),
                   source.indices.to_numpy().astype(np.int32),
                   tuple(source.dictionary.to_pylist()), largest,
                   table["loss_tokens"].to_numpy().astype(np.int64), unit_squares)


def _units(table) -> tuple[np.ndarray, np.ndarray]:
    """Per row its largest ViT unit in tiles (0 for none) and Σ tiles² over its units: an image
    is one unit, a video one per temporal step (its tiles over its grid's t: the ViT attends
    within a step, so a clip splits there)."""
    import pyarrow.compute as pc

    largest = np.zeros(table.num_rows, np.int64)
    squares = np.zeros(table.num_rows, np.float64)
    images, videos = table["image_tiles"].combine_chunks(), table["videos"].combine_chunks()
    tiles, steps, _ = _video_fields(videos)
    for unit, count, rows in (
            (pc.list_flatten(images).to_numpy(zero_copy_only=False).astype(np.int64), 1,
             pc.list_parent_indices(images)),
            (tiles // steps, steps, pc.list_parent_indices(videos))):
        rows = rows.to_numpy()
        np.maximum.at(largest, rows, unit)
        np.add.at(squares, rows, count * unit.astype(np.float64) ** 2)
    return largest, squares


def _video_fields(videos) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Of a stats ``videos`` column's videos, in order: their tiles, temporal steps (grid t)
    and item (place among the sample's images and videos)."""
    import pyarrow.compute as pc

    flat = pc.list_flatten(videos)
    return tuple(a.to_numpy(zero_copy_only=False) for a in (
        pc.struct_field(flat, "tiles"), pc.list_element(pc.struct_field(flat, "grid"), 0),
        pc.struct_field(flat, "item")))


def read_media_units(path: str) -> MediaUnits:
    """The stats' media as ViT units in token order (``MediaUnits``): a sample's images fill
    the items its videos (at their ``item``) leave, in order."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    table = pa.concat_tables(pq.read_table(f, columns=["image_tiles", "videos"])
                             for f in stats_files(path))
    images, videos = table["image_tiles"].combine_chunks(), table["videos"].combine_chunks()
    video_tiles, steps, video_item = _video_fields(videos)
    image_tiles = pc.list_flatten(images).to_numpy(zero_copy_only=False)
    image_at = images.offsets.to_numpy() - images.offset
    video_at = videos.offsets.to_numpy() - videos.offset
    offsets, tiles, units = [0], [], []
    for i in range(table.num_rows):
        media = in_token_order(image_tiles[image_at[i]:image_at[i + 1]].tolist(),
                               {int(video_item[j]): (int(video_tiles[j]), int(steps[j]))
                                for j in range(video_at[i], video_at[i + 1])})
        tiles.extend(t for t, _ in media)
        units.extend(u for _, u in media)
        offsets.append(len(tiles))
    return MediaUnits(np.array(offsets, np.int64), np.array(tiles, np.int64),
                      np.array(units, np.int64))


def _read_omnibal(path: str) -> tuple[Lengths, list[str]]:
    data = _read_json(path)
    if isinstance(data, list):
        name = os.path.splitext(os.path.basename(path))[0]
        return _lengths_from_parts([(name, path, data)]), [path]
    if not isinstance(data, dict):
        raise StatsError(f"{path}: expected an OmniBal length list or meta object")
    parts = []
    for name, entry in data.items():
        if not isinstance(entry, dict) or "token_lengths" not in entry:
            log.warning("%s: %r has no token_lengths; skipped (as OmniBal does)", path, name)
            continue
        file = _resolve(entry["token_lengths"], os.path.dirname(os.path.abspath(path)))
        rows = _read_json(file)
        if not isinstance(rows, list):
            raise StatsError(f"{file}: expected a JSON list of {{vit_num, token_num}}")
        parts.append((name, file, rows))
    return _lengths_from_parts(parts), [p[1] for p in parts]


def _resolve(ref: str, base: str) -> str:
    for candidate in (os.path.join(base, ref), ref):
        if os.path.exists(candidate):
            return candidate
    raise StatsError(f"token_lengths file {ref!r} not found next to the meta file or in the "
                     f"working directory")


def _read_json(path: str):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise StatsError(f"{path}: cannot read JSON ({e})") from e


def _lengths_from_parts(parts: list[tuple[str, str, list]]) -> Lengths:
    tiles, tokens, source = [], [], []
    for k, (name, file, rows) in enumerate(parts):
        try:
            v = np.array([r["vit_num"] for r in rows], dtype=np.int64)
            t = np.array([r["token_num"] for r in rows], dtype=np.int64)
        except (KeyError, TypeError, ValueError) as e:
            bad = next(i for i, r in enumerate(rows) if not _valid_row(r))
            raise StatsError(f"{file}: row {bad} needs integer vit_num and token_num, got "
                             f"{rows[bad]!r}") from e
        if len(rows) and (v.min() < 0 or t.min() < 1):
            bad = int(np.flatnonzero((v < 0) | (t < 1))[0])
            raise StatsError(f"{file}: row {bad} has vit_num < 0 or token_num < 1: {rows[bad]!r}")
        tiles.append(v)
        tokens.append(t)
        source.append(np.full(len(rows), k, np.int32))
    if not parts:
        return Lengths(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int32), ())
    return Lengths(np.concatenate(tiles), np.concatenate(tokens), np.concatenate(source),
                   tuple(p[0] for p in parts))


def _valid_row(row) -> bool:
    try:
        return all(isinstance(row[k], int) and not isinstance(row[k], bool)
                   for k in ("vit_num", "token_num"))
    except (KeyError, TypeError):
        return False
