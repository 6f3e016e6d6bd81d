"""Options of ``vlmshard train`` and ``vlmshard train profile``: one definition each."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, replace
from typing import Literal

from vlmshard.config import ConfigError, option, parse_size
from vlmshard.families import model_types
from vlmshard.recipe import Recipe, RecipeOptions

Precision = Literal["bf16", "fp32"]
SchedulerName = Literal["cosine", "linear", "constant", "constant_with_warmup"]
# the parts whose repeated blocks --compile-blocks compiles (vlmshard.train.clock.PARTS)
CompiledPart = Literal["vit", "llm"]
# the attention backends (vlmshard.train.attention.IMPLEMENTATIONS), or the best that runs
Attention = Literal["auto", "flash", "varlen", "sdpa"]


@dataclass(kw_only=True)
class TrainConfig(RecipeOptions):
    """Options of ``vlmshard train``."""

    shards: str = option(help="shard folder or URL")
    out: str = option(help="run folder: train_log.jsonl, checkpoints/, train_config.json")
    model: str | None = option(
        None, help="Hugging Face model folder to fine-tune (config.json, safetensors weights, "
                   "tokenizer and processor files) whose model_type a family serves: "
                   f"{', '.join(model_types())}",
        default_text="the folder the shards were preprocessed with (--model of preprocess)")
    pp: int = option(1, help="pipeline stages")
    dp: int = option(1, help="data-parallel replicas (shards planned for V virtual ranks serve "
                             "any DP dividing V)")
    max_steps: int | None = option(None, help="optimizer steps; more than the shards hold "
                                              "repeats them",
                                   default_text="one pass over the shards")
    zero: int = option(
        1, help="DeepSpeed ZeRO stage: 1 shards the optimizer states over the DP ranks (with "
                "bf16; the only stage DeepSpeed's pipeline engine takes); 2 also the gradients "
                "and 3 also the parameters, at --pp 1, through DeepSpeed's plain engine (each "
                "rank loads the whole model once, then ZeRO-3 partitions it)")
    zero3_persistence_threshold: int | None = option(
        None, help="under --zero 3, weights of at most this many elements stay gathered on "
                   "every rank through forward and backward instead of being gathered around "
                   "each use (DeepSpeed's stage3_param_persistence_threshold: fewer, smaller "
                   "collectives for norms and biases; their memory is not split); 0 splits "
                   "every weight", default_text="DeepSpeed's, 100000")
    lr: float = option(1e-5, help="AdamW peak learning rate (fine-tuning a pretrained "
                                  "checkpoint; a tiny model trained from scratch wants ~1e-3)")
    lr_scheduler_type: SchedulerName = option(
        "cosine", help="the learning-rate schedule after warm-up, by Hugging Face's name "
                       "(transformers.get_scheduler): cosine or linear decay to 0 at the last "
                       "step, constant, or constant_with_warmup")
    warmup_steps: float = option(
        0.03, help="linear warm-up from 0 to --lr, as Hugging Face's Trainer reads it: a whole "
                   "number >= 1 is steps, a fraction in [0, 1) a share of the run's steps "
                   "(rounded up); the constant schedule has none")
    weight_decay: float = option(0.0, help="AdamW weight decay")
    max_grad_norm: float = option(1.0, help="clip the global gradient norm to this (0: no "
                                            "clipping), as Hugging Face's Trainer does")
    seed: int = option(0, help="model initialization seed")
    precision: Precision | None = option(
        None, help="bf16: weights, activations and pixels in bfloat16, fp32 master weights "
                   "and optimizer states (DeepSpeed's BF16 optimizer), gradients accumulated "
                   "as --grad-accum says; fp32: all fp32 (TF32 matmuls on GPU)",
        default_text="bf16 on GPU, fp32 on CPU")
    grad_accum: Literal["fp32", "bf16"] = option(
        "fp32", help="with bf16: the dtype gradients accumulate in over the plan's micro-batches; "
                     "bf16 saves 4 bytes per parameter, and DeepSpeed warns it is not numerically "
                     "safe over many accumulation steps")
    loader_workers: int | None = option(
        None, help="DataLoader worker processes per first-stage rank, decoding images ahead of "
                   "the step (0: in the training process)", default_text="4 on GPU, 0 on CPU")
    partition: str | None = option(
        None, help="partition.json from 'vlmshard train profile': its chosen stage bounds and "
                   "per-stage recompute", default_text="--bounds, else searched")
    bounds: list[int] | None = option(
        None, help="stage boundaries as layer indices (PP + 1 of them), instead of --partition",
        default_text="the exact search over the model's analytic FLOPs and memory at the "
                     "shards' micro-batch sizes and the device's memory, with the recompute "
                     "each stage then needs")
    recompute: list[str] = option(factory=list,
                                  help="layer names whose activations are recomputed in backward "
                                       "(besides those a searched partition recomputes)")
    selective: list[str] = option(
        factory=list, help="layer names recomputed selectively in backward: the outputs of "
                           "their matmuls and attention kernels kept, the elementwise work "
                           "between them recomputed (besides those a searched partition picks)")
    merge: bool = option(
        False, help="with --lora-rank: also write the weights with each adapter folded in "
                    "(W + alpha / rank x B·A) as a Hugging Face folder, OUT/hf, beside the "
                    "adapter folder OUT/adapter")
    checkpoint_every: int | None = option(
        200, help="also save a DeepSpeed checkpoint every N steps, so a crash loses at most N "
                  "steps (YAML null: at the end only)")
    gc_every: int = option(
        50, help="collect Python's garbage between steps every N steps, with automatic "
                 "collection off and the set-up frozen, so no collection stalls a step "
                 "(0: Python's own schedule)")
    save_checkpoints: bool = option(True, help="save DeepSpeed checkpoints at all (off for short "
                                               "validation runs)")
    attention: Attention = option(
        "auto", help="the kernel packed samples attend with: flash (flash-attn's varlen kernel), "
                     "varlen (torch's varlen flash kernel, one call a micro-batch; CUDA, bf16), "
                     "sdpa (scaled_dot_product_attention on each sample or image alone, those "
                     "of one length in a row batched; with --sdpa-cudnn cuDNN's kernel first); "
                     "auto: the first of these that runs on the device in the run's precision")
    vit_varlen: bool = option(
        True, help="a Qwen ViT block attends over every image (or window) of the micro-batch "
                   "in one call of the attention backend (on CUDA one varlen kernel), where "
                   "transformers calls it once per image (flash-attn already takes one call)")
    liger: bool | None = option(
        None, help="Liger Kernel's fused Triton kernels in every layer: RMSNorm, the gated MLP's "
                   "activation x up projection (SwiGLU, GeGLU) and the rotary embeddings, where "
                   "Liger's own patch of the family puts them (GPU only; pip install "
                   "'vlmshard[gpu]' or liger-kernel)",
        default_text="on where it runs: CUDA with liger-kernel installed")
    sdpa_cudnn: bool = option(
        False, help="scaled_dot_product_attention tries cuDNN's fused attention before its flash "
                    "kernel, in every layer: a Qwen ViT then attends on SDPA in its one call "
                    "(consecutive images of one size batched; not torch's varlen flash "
                    "kernel), and so do InternVL's and "
                    "Gemma 3's ViTs and the layers that fall back to SDPA. On Hopper, "
                    "transformers#48163 measured cuDNN's 1.7-2.3x flash's training speed; not "
                    "yet measured here")
    patch_linear: bool | None = option(
        None, help="a Qwen ViT's patch embedding (a Conv3d whose stride is its kernel) runs as "
                   "the matmul it is: cuDNN has no fast kernel for that conv on some GPUs and "
                   "releases", default_text="on with CUDA")
    compile_blocks: list[CompiledPart] = option(
        factory=list, metavar="PART",
        help="torch.compile the repeated blocks of these parts: vit (the ViT blocks), llm (the "
             "decoder layers), or both (regional compilation), the packed length dynamic; the "
             "compilations are counted in the log. Inductor then fuses those blocks' norms, "
             "activations and rotary embeddings in place of Liger's kernels, which stay in the "
             "other layers", default_text="none")
    max_recompiles: int = option(
        4, help="with --compile-blocks, warn when torch.compile compiles one frame more than "
                "this many times again: a block kind compiles each frame at most twice (fixed "
                "shapes, then dynamic), a frame block kinds share once or twice per kind; more "
                "means packed shapes recompile")
    count_host_syncs: bool = option(
        False, help="count each step's synchronizing CUDA calls (torch.cuda's sync debug mode, "
                    "on GPU) and torch.cuda.synchronize calls, and log them per rank as "
                    "host_syncs, with host_sync_sites: the file:line of each (slows the step)")
    trace: str | None = option(
        None, help="write a torch profiler trace (Chrome trace JSON, one file per rank) of the "
                   "run's second step to this folder, that step's log line saying traced; and "
                   "where the host's Python was in the third step (sampled each millisecond, "
                   "host-rank{R}-step{S}.json)",
        default_text="no trace")
    hostfile: str | None = option(
        None, help="DeepSpeed hostfile ('HOST slots=N' per line): start every node from this one "
                   "over passwordless ssh. Without it, a job started on every node (srun, or "
                   "torchrun-style NNODES, NODE_RANK, NPROC_PER_NODE, MASTER_ADDR) runs this "
                   "node's share", default_text="this node alone, or the job's environment")
    master_port: int | None = option(
        None, help="node 0's rendezvous port",
        default_text="MASTER_PORT, else a free port on one node, 29500 on several")
    resume: str | None = option(
        None, help="run folder to continue from its latest checkpoint; the data position follows "
                   "from the step", default_text="start afresh")

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("pp", "dp"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name} must be at least 1, got {getattr(self, name)}")
        if self.loader_workers is not None and self.loader_workers < 0:
            raise ConfigError(f"--loader-workers must be at least 0, got {self.loader_workers}")
        if self.zero not in (1, 2, 3):
            raise ConfigError(f"--zero takes 1, 2 or 3, got {self.zero}")
        if self.zero > 1 and self.pp != 1:
            raise ConfigError(f"--zero {self.zero} shards what pipeline stages already split: "
                              "DeepSpeed's pipeline engine takes ZeRO-1 only; use --pp 1 "
                              "(data parallel alone) or --zero 1")
        if self.zero3_persistence_threshold is not None and (
                self.zero != 3 or self.zero3_persistence_threshold < 0):
            raise ConfigError("--zero3-persistence-threshold takes a number of elements, at "
                              f"least 0, with --zero 3; got {self.zero3_persistence_threshold}"
                              f" with --zero {self.zero}")
        if self.merge and not self.lora_rank:
            raise ConfigError("--merge folds LoRA adapters into their weights: it needs "
                              "--lora-rank (a run without LoRA writes OUT/hf as it is)")
        if self.warmup_steps < 0 or (self.warmup_steps >= 1
                                     and self.warmup_steps != int(self.warmup_steps)):
            raise ConfigError("--warmup-steps takes a whole number of steps or a fraction in "
                              f"[0, 1) of the run's steps, got {self.warmup_steps}")
        if self.gc_every < 0:
            raise ConfigError(f"--gc-every must be at least 0, got {self.gc_every}")
        for name in ("max_steps", "checkpoint_every"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be at least 1, got {value}")

    @property
    def recipe(self) -> Recipe:
        """What trains (``RecipeOptions.recipe``), LoRA's adapters initialized from ``seed``."""
        recipe = super().recipe
        return replace(recipe, lora=replace(recipe.lora, seed=self.seed)) if recipe.lora \
            else recipe

    def resolve_device_defaults(self, cuda: bool) -> None:
        """Fill the options whose default depends on whether the ranks have GPUs."""
        if self.precision is None:
            self.precision = "bf16" if cuda else "fp32"
        if self.loader_workers is None:
            self.loader_workers = 4 if cuda else 0
        if self.patch_linear is None:
            self.patch_linear = cuda
        from .models import liger

        if self.attention != "auto":  # it runs there (imported only then: it loads transformers)
            from .attention import choose_backend

            choose_backend("cuda" if cuda else "cpu", self.dtype, self.attention)
        if self.liger is None:
            self.liger = liger.available()
        elif self.liger and not liger.available():
            raise ConfigError("--liger: Liger's kernels run on CUDA with liger-kernel installed "
                              "(pip install liger-kernel); "
                              + ("it is not installed" if cuda else "this machine has no GPU"))

    def warmup_steps_of(self, steps: int) -> int:
        """The warm-up steps of a run of ``steps`` optimizer steps (Hugging Face's
        ``TrainingArguments.get_warmup_steps`` rule; the constant schedule has none)."""
        if self.lr_scheduler_type == "constant":
            return 0
        if self.warmup_steps >= 1:
            return int(self.warmup_steps)
        return math.ceil(steps * self.warmup_steps)

    @property
    def dtype(self):
        """The torch dtype of weights and activations for ``precision``."""
        import torch

        return {"bf16": torch.bfloat16, "fp32": torch.float32}[self.precision or "fp32"]

    def training_options(self) -> "TrainConfig":
        """The training options alone: what the training processes read (a ProfileConfig is a
        TrainConfig plus the profiling options)."""
        return TrainConfig(**{f.name: getattr(self, f.name)
                              for f in dataclasses.fields(TrainConfig)})

    def use_partition(self, described: dict) -> None:
        """Bounds and recompute from a partition as ``vlmshard.train.profile.describe`` writes
        it."""
        self.bounds = described["bounds"]
        self.recompute = [name for stage in described["stages"] for name in stage["recompute"]]
        self.selective = [name for stage in described["stages"]
                          for name in stage.get("selective", [])]


@dataclass(kw_only=True)
class ProfileConfig(TrainConfig):
    """Options of ``vlmshard train profile``: the training options plus the profiling ones."""

    memory_budget: int | str = option("80GiB", help="memory per pipeline stage, e.g. 80GiB")
    micro_batches: int = option(4, help="micro-batches to profile")
    repeats: int = option(3, help="timed runs of each layer on each micro-batch; the median "
                                  "counts")
    warmup: int = option(1, help="untimed runs of each layer on each micro-batch first (on a "
                                 "GPU the first run pays cuBLAS heuristics and allocator "
                                 "growth)")
    device: str | None = option(None, help="cpu or cuda", default_text="cuda when available")
    link_bytes_per_s: float = option(25e9, help="bandwidth between pipeline stages, for the "
                                                "boundary transfer times")
    validate_top: int = option(0, help="train real steps with the K best candidates and choose "
                                       "the fastest measured (0: choose the search's)")
    validate_steps: int = option(4, help="steps per validated candidate, the first untimed")

    def __post_init__(self) -> None:
        super().__post_init__()
        parse_size(self.memory_budget)
        if self.repeats < 1 or self.warmup < 0:
            raise ConfigError(f"--repeats must be >= 1 and --warmup >= 0, got {self.repeats} "
                              f"and {self.warmup}")
        if self.validate_top < 0 or self.validate_steps < 2:
            raise ConfigError("--validate-top must be >= 0 and --validate-steps >= 2 (the first "
                              "step is warm-up)")
