"""Synthetic length distributions for the caps matrix (``test_caps_matrix.py``): shapes of real
VLM data mixes that stress a packer differently, plus OmniBal's two real files
(``tests/data/omnibal``); and ``mostly_text``, whose images no default cap of a few mean samples
holds (groups' and the report's baselines' tests).

The real ones are the whole of OmniBal's ai2d (12,413 rows) and docvqa (10,211 rows) length files
(``tests/data/omnibal/full_lengths.npz``: their ``vit_num`` and ``token_num`` columns). Sizes of
the synthetic ones follow InternVL's layout: a 448-px tile makes 256 image tokens, so a sample's
seq_len is 256 per tile plus its text. Every mix is a pure function of (name, n, seed).
"""

from __future__ import annotations

import json
import os

import numpy as np

from vlmshard.packing.batches import Lengths

TOKENS_PER_TILE = 256
OMNIBAL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "omnibal")


def _text(rng, n, median, sigma, low, high):
    return np.clip(np.round(rng.lognormal(np.log(median), sigma, n)), low, high).astype(np.int64)


def tile_heavy(rng, n):
    """Most samples 4–6 tiles with short text, as OmniBal's chartqa/synthdog files."""
    tiles = rng.choice([1, 2, 3, 4, 5, 6, 7, 8, 12], n,
                       p=[.03, .02, .03, .3, .35, .22, .02, .02, .01])
    return tiles, _text(rng, n, 120, 0.6, 20, 1500)


def text_heavy(rng, n):
    """One tile and long text: documents, multi-turn chat."""
    return np.ones(n, np.int64), _text(rng, n, 1400, 0.5, 100, 7000)


def bimodal(rng, n):
    """Half single-tile short questions, half many-tile documents."""
    big = rng.random(n) < 0.5
    tiles = np.where(big, rng.integers(6, 13, n), 1)
    text = np.where(big, _text(rng, n, 600, 0.4, 100, 3000), _text(rng, n, 80, 0.5, 10, 400))
    return tiles, text


def long_tailed(rng, n):
    """Typical 2-tile samples, and 1% eight times the median on both sides."""
    tiles = rng.choice([1, 2, 3], n, p=[.3, .5, .2])
    text = _text(rng, n, 200, 0.5, 20, 2000)
    tail = rng.random(n) < 0.01
    tiles = np.where(tail, 8 * 2, tiles)
    text = np.where(tail, 8 * 200 + rng.integers(0, 400, n), text)
    return tiles, text


def single_tile_short(rng, n):
    """One tile and a short caption or answer each."""
    return np.ones(n, np.int64), _text(rng, n, 60, 0.5, 8, 300)


SYNTHETIC = {"tile-heavy": tile_heavy, "text-heavy": text_heavy, "bimodal": bimodal,
             "long-tailed": long_tailed, "single-tile-short": single_tile_short}
REAL = ("omnibal-ai2d", "omnibal-docvqa")
MIXES = tuple(SYNTHETIC) + REAL


def mix(name: str, n: int = 20000, seed: int = 0) -> Lengths:
    """The ``name`` mix as packer lengths: ``n`` samples drawn with ``seed`` (the real files
    give their own rows, ``n`` and ``seed`` aside)."""
    if name in REAL:
        key = name.removeprefix("omnibal-")
        with np.load(os.path.join(OMNIBAL, "full_lengths.npz")) as rows:
            tiles = rows[f"{key}_vit_num"].astype(np.int64)
            tokens = rows[f"{key}_token_num"].astype(np.int64)
    else:
        tiles, text = SYNTHETIC[name](np.random.default_rng(seed), n)
        tiles = tiles.astype(np.int64)
        tokens = tiles * TOKENS_PER_TILE + text.astype(np.int64)
    return Lengths(tiles, tokens, np.zeros(len(tiles), np.int32), (name,))


def mostly_text() -> Lengths:
    """Lengths shaped as LLaMA-Factory's demo data: 200 short texts (no tiles, 300 to 349
    tokens), 3 image samples of 20 tiles and 2000 tokens, 2 long texts of 3500 tokens. The
    mean sample has 0.3 tiles: 4 of them hold no image."""
    rows = [(0, 300 + i % 50) for i in range(200)] + [(20, 2000)] * 3 + [(0, 3500)] * 2
    return Lengths(np.array([v for v, _ in rows]), np.array([t for _, t in rows]),
                   np.zeros(len(rows), np.int32), ("mostly-text",))


def write_length_file(path, lengths: Lengths) -> str:
    """``lengths`` as an OmniBal length file (``vit_num``, ``token_num`` per row) at ``path``."""
    rows = [{"vit_num": int(v), "token_num": int(t)} for v, t in zip(lengths.tiles, lengths.tokens)]
    with open(path, "w") as f:
        json.dump(rows, f)
    return str(path)
