"""What every model family provides, and the pieces their image processors share.

A family (``Family``) is everything the stages need to know about one kind of model: the
``model_type`` values of ``config.json`` it serves, how its chat template's image placeholder
becomes tokens (``ImageLayout``), how an image becomes ViT units, LLM tokens and pixels (its
``TilingPolicy``, with the limits the folder's processor config sets), how position ids run,
the model's sizes for the analytic cost model (those a ``config.json`` states, with the
features its layers have that the file does not say, and named presets), the tiny offline
folders tests and the demo use, and where the trainer's layer map lives.
``vlmshard.families.registry`` holds one instance per family; the stages ask it and name no family.

Counting needs only an image's size, so preprocessing reads headers and never decodes pixels; the
same policy objects are recorded in ``preprocess.json`` and the shards' manifest, and the loader
makes the model's ``pixel_values`` with ``pixels``, so the pixels always match the plan.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, ClassVar, Literal, Protocol

import numpy as np

from vlmshard.io import sha256_file

if TYPE_CHECKING:
    from PIL import Image

    from vlmshard.model_sizes import ModelConfig

    from .folder import ModelFolder


IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
BICUBIC = 3  # PIL's filter number, as preprocessor_config.json writes ``resample``

# per-image: every image may use the family's tile limit, as transformers applies it.
# per-sample: the images of a sample share it, as InternVL's own training code divides it.
TileBudget = Literal["per-image", "per-sample"]


class TilingPolicy(Protocol):
    """How one family's image processor turns an image into ViT units ("tiles"), LLM tokens and
    pixel rows. ``name`` is the policy's kind, recorded with it (``policy_from_dict``)."""

    name: str
    tokens_per_tile: int
    tile_size: int  # side of a tile's square of the resized image, in pixels
    rows_per_tile: int  # rows of pixel_values per tile (1 tile, or merge² ViT patches)
    pixel_shape: tuple[int, ...]  # the shape of one row of pixel_values
    takes_grid: bool  # whether the model's forward takes image_grid_thw

    def tiles(self, width: int, height: int, n_images: int) -> int:
        """Tiles for one image of a sample holding ``n_images`` images; raises ``Reject``."""

    def grid_thw(self, width: int, height: int) -> tuple[int, int, int] | None:
        """The image's ViT patch grid, where the model takes one (``image_grid_thw``)."""

    def pixels(self, image: "Image.Image", n_images: int) -> np.ndarray:
        """The model's float32 ``pixel_values`` rows for a decoded RGB image (one per tile for
        InternVL, one per ViT patch for Qwen2-VL), normalized as its processor does."""

    def with_limits(self, max_patches: int | None = None,
                    budget: TileBudget | None = None) -> "TilingPolicy | None":
        """This policy with a per-image tile limit and budget (``--max-patches``, an InternVL
        meta file's ``max_dynamic_patch``), or None if the family has no such limit."""

    def to_dict(self) -> dict: ...


@dataclass(frozen=True)
class Normalized:
    """What every processor does after resizing: ``x · rescale_factor``, minus mean, over std."""

    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    resample: int = BICUBIC
    rescale_factor: float = 1 / 255

    def normalize(self, pixels: np.ndarray) -> np.ndarray:
        """uint8 [..., H, W, 3] → float32 [..., 3, H, W]."""
        x = pixels.astype(np.float32) * np.float32(self.rescale_factor)
        x = (x - np.asarray(self.mean, np.float32)) / np.asarray(self.std, np.float32)
        return np.moveaxis(x, -1, -3)

    def resize(self, image: "Image.Image", width: int, height: int) -> np.ndarray:
        from PIL import Image

        return np.asarray(image.resize((width, height), Image.Resampling(self.resample)))

    def with_limits(self, max_patches: int | None = None,
                    budget: TileBudget | None = None) -> None:
        return None  # no per-image tile limit unless the family's policy has one

    def to_dict(self) -> dict:
        return {"name": self.name, **asdict(self)}


class SquareTiles:
    """A policy whose tile is a square of ``image_size`` px, one row [3, S, S] of pixel_values
    each, and whose model takes no image grid (InternVL's crops, Gemma 3's images)."""

    image_size: int
    rows_per_tile: ClassVar[int] = 1
    takes_grid: ClassVar[bool] = False

    @property
    def tile_size(self) -> int:
        return self.image_size

    @property
    def pixel_shape(self) -> tuple[int, ...]:
        return 3, self.image_size, self.image_size

    def grid_thw(self, width: int, height: int) -> None:
        return None  # the model's forward takes tiles, no grid


def to_rgb(image: "Image.Image") -> "Image.Image":
    """RGB as ``transformers`` converts: transparency composited onto white."""
    from PIL import Image

    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


@dataclass(frozen=True)
class ImageLayout:
    """An image's tokens: the chat template renders ``placeholder`` once per image, and it
    becomes ``prefix`` + ``token`` × (the image's tokens) + ``suffix``, with the text ``around``
    it (Gemma 3's processor writes ``"\\n\\n"`` on each side; the text is tokenized together
    with the template's next to it, as the processor's string replacement has it). An image of
    several ``tile_tokens`` runs (Gemma 3's pan-and-scan: the image, then its crops) becomes
    ``crops[0]``, the first run, ``crops[1]``, then the others joined by ``crops[2]``."""

    placeholder: str
    token: str
    prefix: tuple[str, ...] = ()
    suffix: tuple[str, ...] = ()
    around: tuple[str, str] = ("", "")
    tile_tokens: int = 0  # the tokens of one run, where an image may have several
    crops: tuple[str, str, str] = ("", "", "")
    # the template's tokens right around the placeholder that its expansion replaces (Qwen3-VL's
    # video: each frame brings its own <|vision_start|>…<|vision_end|>)
    replaces: tuple[str, str] = ("", "")

    def pieces(self, count: int) -> list[str | int]:
        """An image of ``count`` tokens as text (str) and runs of ``token`` (int), in order;
        each run is wrapped in ``prefix`` and ``suffix``."""
        if not self.tile_tokens or count <= self.tile_tokens:
            return [self.around[0], count, self.around[1]]
        run = [self.around[0], self.tile_tokens, self.around[1]]
        out = [self.crops[0], *run, self.crops[1]]
        for i in range(count // self.tile_tokens - 1):
            out += ([self.crops[2]] if i else []) + run
        return out


@dataclass(frozen=True)
class SampledVideo:
    """A video as one family takes it: the frames it keeps (indices into the decoded stream, or
    into a frame list; the last repeated where the model needs whole temporal patches), their
    resized size, the model's grid and the video's ViT units and LLM tokens."""

    indices: tuple[int, ...]
    width: int
    height: int
    grid: tuple[int, int, int]  # (t, h, w): Qwen's video_grid_thw; (frames, 1, 1) for tiles
    tiles: int  # ViT units, in the family's unit (as image tiles count)
    tokens: int  # LLM tokens its embeddings fill
    seconds_per_step: float  # time between temporal steps (Qwen2.5-VL's second_per_grid_ts)
    fps: float  # the source's frame rate (frame index / fps = time)
    timestamps: tuple[float, ...] = ()  # each temporal step's time, where the text says it


def float_arange(start: float, stop: float, step: float) -> np.ndarray:
    """``torch.arange(start, stop, step).int()`` as the video processors compute frame indices:
    the points in float32 (torch's default dtype), truncated."""
    count = max(0, math.ceil((stop - start) / step))
    return (start + np.arange(count) * step).astype(np.float32).astype(np.int64)


@dataclass(frozen=True)
class ModelSpec:
    """What preprocessing recorded about the model: the family, its image layout, and the
    folder's files by sha256 (a later stage that re-tokenizes checks they did not change)."""

    family: str
    path: str | None  # None: the offline Tekken demo
    model_type: str = ""
    layout: ImageLayout = field(default_factory=lambda: ImageLayout("[IMG]", "[IMG]"))
    video_layout: ImageLayout | None = None  # None: the family takes no video
    dtype: str = "float32"
    files: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelSpec":
        def layout(value: dict | None) -> ImageLayout | None:
            return None if value is None else ImageLayout(
                **{k: tuple(v) if isinstance(v, list) else v for k, v in value.items()})

        return cls(**{**d, "layout": layout(d["layout"]),
                      "video_layout": layout(d.get("video_layout"))})

    def unchanged(self) -> bool:
        """Whether the folder's files are still there with the same sha256."""
        return all(os.path.isfile(p := os.path.join(self.path, name)) and sha256_file(p) == digest
                   for name, digest in self.files.items())


class Family:
    """A model family. A subclass sets the class attributes and implements the methods; one
    instance of it goes into the registry (``vlmshard.families.registry.register``)."""

    name: ClassVar[str]  # the one name of the family everywhere (stats, plans, shards, CLI)
    model_types: ClassVar[tuple[str, ...]]  # config.json ``model_type`` values it serves
    policies: ClassVar[tuple[type, ...]]  # its TilingPolicy classes (the first: the default)
    # its models' sizes by name (``vlmshard.families.presets``), for profiling, the packer's
    # FLOPs cost model and simulation; each in the ViT unit its stats count
    presets: ClassVar[dict[str, "ModelConfig"]]
    default_preset: ClassVar[str]  # the one of ``presets`` costing its stats
    trainer_layers: ClassVar[str]  # "module:function" giving the trainer's layer list
    description: ClassVar[str]  # a few words for help texts ("Qwen2-VL, Qwen2.5-VL")
    demo_limits: ClassVar[dict] = {}  # ``tiny_folder`` sizes of the demo's model
    # its image tokens attend to their whole image in the LLM (Gemma 3): the trainer needs an
    # attention backend that keeps such runs
    bidirectional_images: ClassVar[bool] = False

    def tiling(self, folder: "ModelFolder") -> TilingPolicy:
        """The tiling policy with the limits of the folder's processor config."""
        raise NotImplementedError

    def default_tiling(self) -> TilingPolicy:
        """The tiling at ``transformers``' defaults (the demo tokenizer has no folder)."""
        return self.policies[0]()

    def layout(self, folder: "ModelFolder") -> ImageLayout:
        raise NotImplementedError

    def video_layout(self, folder: "ModelFolder") -> ImageLayout | None:
        """How the template's video placeholder becomes tokens, or None: the family takes no
        video (a video is then a reject, ``unsupported_video``)."""
        return None

    def video_pieces(self, video: SampledVideo, layout: ImageLayout) -> list[str | int]:
        """A video as text (str) and runs of ``layout.token`` (int), each run wrapped in the
        layout's prefix and suffix, as the family's processor writes it."""
        return [video.tokens]

    def position_ids(self, input_ids: np.ndarray, visual_ids: tuple[int, ...],
                     grids: list[tuple[int, int, int]], policy: TilingPolicy,
                     steps: list[float] | None = None) -> np.ndarray:
        """Position ids of one sample alone, [n] or [3, n]; ``grids`` are the (t, h, w) ViT
        patch grids of its images and videos in token order, whose tokens are those in
        ``visual_ids``; ``steps``: each one's time between temporal steps (0 for an image)."""
        return np.arange(len(input_ids), dtype=np.int64)

    def model_sizes(self, config: dict, name: str) -> "ModelConfig":
        """The sizes a ``config.json`` of this family states, in the ViT unit its stats count."""
        raise NotImplementedError

    def tiny_folder(self, path: str, model_type: str, **sizes) -> str:
        """A tiny offline folder of ``model_type`` (random weights) at ``path``: the tests'
        and the demo's models. ``sizes`` override the family's small defaults."""
        raise NotImplementedError
