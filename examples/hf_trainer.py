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
"""

from __future__ import annotations

import tempfile

import torch
from common import model_and_shards, parser
from torch.utils.data import DataLoader, IterableDataset


class PackedBatches(IterableDataset):
    """One rank's micro-batches as the model's keyword arguments (``model_inputs``)."""

    def __init__(self, shards: str, model, rank: int, world_size: int) -> None:
        from vlmshard.shards.loader import ShardDataset

        self.shards = ShardDataset(shards, rank, world_size, pad_to_caps=False)
        self.model = model

    def __len__(self) -> int:
        return len(self.shards)

    def __iter__(self):
        from vlmshard.shards.model_inputs import model_inputs

        for batch in self.shards:
            yield model_inputs(batch, self.model)


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--out", default=None, help="Trainer output folder (default: a temp folder)")
    args = p.parse_args()
    with model_and_shards(args, p) as (folder, shards), \
            tempfile.TemporaryDirectory(prefix="vlmshard-trainer-") as scratch:
        train(folder, shards, args.out or scratch, args)


def train(folder: str, shards: str, out: str, args) -> None:
    from transformers import AutoModelForImageTextToText, Trainer, TrainingArguments

    cpu = not torch.cuda.is_available()
    model = AutoModelForImageTextToText.from_pretrained(
        folder, dtype=torch.float32 if cpu else torch.bfloat16, attn_implementation=args.attn)
    training = TrainingArguments(
        output_dir=out, max_steps=args.steps,
        per_device_train_batch_size=1, learning_rate=args.lr, lr_scheduler_type="cosine",
        warmup_steps=1, logging_steps=1, save_strategy="no", report_to=[], use_cpu=cpu,
        bf16=not cpu, remove_unused_columns=False, average_tokens_across_devices=True,
        gradient_accumulation_steps=1)  # set below, once the shards say it
    if not cpu:
        model.to(training.device)  # model_inputs puts each batch on the model's device
    data = PackedBatches(shards, model, training.process_index, training.world_size)
    training.gradient_accumulation_steps = data.shards.micro_batches_per_step

    class ShardTrainer(Trainer):
        def get_train_dataloader(self) -> DataLoader:
            return DataLoader(data, batch_size=None)

    ShardTrainer(model=model, args=training, train_dataset=data).train()


if __name__ == "__main__":
    main()
