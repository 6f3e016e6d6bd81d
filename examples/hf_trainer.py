"""Train on vlmshard shards with Hugging Face's ``Trainer``.

    python examples/hf_trainer.py --shards out/shards --model /models/Qwen2-VL-2B --steps 100
    torchrun --nproc-per-node 8 examples/hf_trainer.py --shards ... --model ...   # DDP
    python examples/hf_trainer.py --smoke   # a tiny demo model and shards, 2 CPU steps

One optimizer step per step of the shards: ``gradient_accumulation_steps`` is the number of
micro-batches a rank gets per step. Each process streams its own rank's micro-batches
(``ShardDataset(rank=process_index, world_size=world_size)``: shards packed for V virtual ranks
serve any world size dividing V). The Trainer's own data loader would shard an iterable dataset
again across processes, so ``get_train_dataloader`` returns this rank's loader as it is.

The batches carry ``shift_labels`` (``model_inputs``), which the Trainer counts for
``num_items_in_batch`` and sums over processes (``average_tokens_across_devices``): the loss is
the step's summed token losses over its supervised tokens on all ranks, as ``vlmshard train``
computes it.

``PaddedBatches`` gives the Trainer the same samples per step padded per sample instead, the
common default (``benchmarks/gpu_bench.py --baseline`` times both beside ``vlmshard train``).
"""

from __future__ import annotations

import tempfile

import torch
from common import model_and_shards, parser
from torch.utils.data import IterableDataset


class PackedBatches(IterableDataset):
    """One rank's micro-batches as the model's keyword arguments (``model_inputs``), read by the
    trainer's loader (``workers`` processes decode ahead); ``split`` > 1: each cut into that
    many micro-batches of consecutive samples (``split_micro_batch``), accumulated instead, for
    a device that cannot hold a whole one."""

    def __init__(self, shards: str, model, rank: int, world_size: int, workers: int = 0,
                 split: int = 1) -> None:
        from vlmshard.shards.loader import make_loader

        self.loader = make_loader(shards, rank, world_size, num_workers=workers,
                                  pin_memory=workers > 0 and torch.cuda.is_available(),
                                  pad_to_caps=False)
        self.model = model
        self.split = split

    @property
    def micro_batches_per_step(self) -> int:
        return self.loader.dataset.micro_batches_per_step * self.split

    def __len__(self) -> int:
        return len(self.loader.dataset) * self.split

    def __iter__(self):
        from vlmshard.shards.model_inputs import model_inputs, split_micro_batch

        for batch in self.loader:
            for part in split_micro_batch(batch, self.split) if self.split > 1 else [batch]:
                yield model_inputs(part, self.model)


class PaddedBatches(PackedBatches):
    """The same samples step by step, padded per sample as the common default trains
    (``padded_inputs``): each step's samples shuffled (``seed``) and dealt, in that order, each
    to the micro-batch whose padded size (samples × the longest) grows least (``padded_deal``):
    random micro-batches of about equal padded tokens, the same samples each optimizer step.
    A step has as many micro-batches as a packed step, or more where padding needs them: the
    fewest that keep every one of the first ``steps`` steps' padded micro-batches within
    ``max_tokens`` (default: the shards' token cap, what one packed micro-batch holds), read
    from the shards without their pixels (``fewest_parts``: none empty)."""

    def __init__(self, shards: str, model, rank: int, world_size: int, workers: int = 0, *,
                 seed: int = 0, steps: int | None = None, max_tokens: int | None = None) -> None:
        from vlmshard.shards.loader import ShardDataset

        super().__init__(shards, model, rank, world_size, workers)
        self.seed = seed
        data = ShardDataset(shards, rank, world_size, pixels=False, pad_to_caps=False)
        packed = data.micro_batches_per_step
        lengths, step = [], []  # each step's sample lengths, in the order the loader gives them
        for n, batch in enumerate(data, 1):
            cu = batch["cu_seqlens"][:int(batch["num_samples"]) + 1]
            step += (cu[1:] - cu[:-1]).tolist()
            if n % packed == 0:
                lengths.append(step)
                step = []
                if len(lengths) == steps:
                    break
        self.parts = fewest_parts(lengths, packed, max_tokens or data.manifest.qt, seed)

    @property
    def micro_batches_per_step(self) -> int:
        return self.parts

    def __len__(self) -> int:  # the Trainer's steps per epoch: micro-batches / accumulation
        return len(self.loader.dataset) // self.loader.dataset.micro_batches_per_step * self.parts

    def __iter__(self):
        import random

        from vlmshard.shards.model_inputs import padded_inputs, split_batch

        rng, step = random.Random(self.seed), []
        for batch in self.loader:
            step.append(batch)
            if len(step) < self.loader.dataset.micro_batches_per_step:
                continue
            samples = [s for b in step for s in split_batch(b, self.model)]
            for part in padded_deal([s["input_ids"].shape[1] for s in samples], self.parts, rng):
                yield padded_inputs([samples[i] for i in part], self.model)
            step = []


def padded_deal(lengths: list[int], parts: int, rng) -> list[list[int]]:
    """The indices of samples of ``lengths`` in ``parts`` micro-batches: taken in a random
    order (``rng``), each to the micro-batch whose padded size (samples × the longest) grows
    least, the first of equals."""
    order = list(range(len(lengths)))
    rng.shuffle(order)
    dealt, longest = [[] for _ in range(parts)], [0] * parts
    for i in order:
        k = min(range(parts), key=lambda j: (len(dealt[j]) + 1) * max(longest[j], lengths[i]))
        dealt[k].append(i)
        longest[k] = max(longest[k], lengths[i])
    return dealt


def fewest_parts(steps: list[list[int]], least: int, max_tokens: int, seed: int) -> int:
    """The fewest micro-batches a step (at least ``least``, at most the samples of the step
    with fewest: none may be empty) for which ``padded_deal``, replayed over ``steps`` (each
    step's sample lengths) from ``seed``, keeps every padded micro-batch within
    ``max_tokens``; where none does, that most."""
    import random

    most = max(least, min((len(s) for s in steps), default=least))
    for parts in range(least, most + 1):
        rng = random.Random(seed)
        if all(len(part) * max((lengths[i] for i in part), default=0) <= max_tokens
               for lengths in steps for part in padded_deal(lengths, parts, rng)):
            return parts
    return most


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--out", default=None, help="Trainer output folder (default: a temp folder)")
    p.add_argument("--train", nargs="+", default=["vit", "projector", "llm"], metavar="PART",
                   help="the parts that train, as vlmshard train --train (default: all)")
    p.add_argument("--lora-rank", type=int, default=0,
                   help="LoRA on the LLM, as vlmshard train --lora-rank (0: none)")
    args = p.parse_args()
    with model_and_shards(args, p) as (folder, shards), \
            tempfile.TemporaryDirectory(prefix="vlmshard-trainer-") as scratch:
        train(folder, shards, args.out or scratch, args)


def shard_trainer(model, batches, out: str, steps: int, callbacks=(), **options):
    """A ``Trainer`` of ``model`` over ``batches(rank, world_size)`` (``PackedBatches``,
    ``PaddedBatches``), one optimizer step per step of the shards; ``options`` go to its
    ``TrainingArguments``."""
    from torch.utils.data import DataLoader
    from transformers import Trainer, TrainingArguments

    cpu = not torch.cuda.is_available()
    training = TrainingArguments(
        output_dir=out, max_steps=steps, per_device_train_batch_size=1, logging_steps=1,
        save_strategy="no", report_to=[], use_cpu=cpu, remove_unused_columns=False,
        average_tokens_across_devices=True, **options)
    model.to(training.device)  # model_inputs puts each batch on the model's device
    data = batches(training.process_index, training.world_size)
    training.gradient_accumulation_steps = data.micro_batches_per_step

    class ShardTrainer(Trainer):
        def get_train_dataloader(self) -> DataLoader:
            return DataLoader(data, batch_size=None)

    trainer = ShardTrainer(model=model, args=training, train_dataset=data,
                           callbacks=list(callbacks))
    # Qwen3-VL and Gemma 3 declare ``accepts_loss_kwargs = False`` (for Gemma 3's gradient
    # accumulation), so the Trainer would average the micro-batches' mean losses; their forwards
    # do hand ``num_items_in_batch`` to the loss, which makes it the step's Ave-Token loss
    trainer.model_accepts_loss_kwargs = True
    return trainer


def train(folder: str, shards: str, out: str, args) -> None:
    from transformers import AutoModelForImageTextToText

    from vlmshard.recipe import RecipeOptions
    from vlmshard.shards.model_inputs import TORCH_VARLEN
    from vlmshard.train.attention import attend_with_torch_varlen
    from vlmshard.train.hf_model import model_layers

    cpu = not torch.cuda.is_available()
    varlen = args.attn == TORCH_VARLEN  # set after loading (attend_with_torch_varlen)
    model = AutoModelForImageTextToText.from_pretrained(
        folder, dtype=torch.float32 if cpu else torch.bfloat16,
        attn_implementation="sdpa" if varlen else args.attn)
    if varlen:
        attend_with_torch_varlen(model)
    # trained as vlmshard train trains: the parts --train leaves out frozen, LoRA's adapters
    model = model_layers(folder, recipe=RecipeOptions(
        train=args.train, lora_rank=args.lora_rank).recipe).as_recipe(model)
    if args.lora_rank:
        model.print_trainable_parameters()
    shard_trainer(model, lambda rank, world: PackedBatches(shards, model, rank, world), out,
                  args.steps, learning_rate=args.lr, lr_scheduler_type="cosine",
                  warmup_steps=1, bf16=not cpu).train()


if __name__ == "__main__":
    main()
