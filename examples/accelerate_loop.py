"""Train on vlmshard shards with Hugging Face Accelerate (DDP, or FSDP2 with its config).

    accelerate launch examples/accelerate_loop.py --shards out/shards --model /models/InternVL3-1B
    accelerate launch --config_file fsdp2.yaml examples/accelerate_loop.py ...   # FSDP2
    python examples/accelerate_loop.py --smoke    # a tiny demo model and shards, 2 CPU steps

Each process streams its own rank's micro-batches (``make_loader(rank=process_index,
world_size=num_processes)``; the loader is not passed to ``accelerator.prepare``, which would
shard it again). Per step: the step's supervised tokens are summed over processes and divided
by their number, so that the gradients Accelerate averages over processes are those of the
step's summed token losses over all its supervised tokens (Ave-Token, as ``vlmshard train``);
gradients are synchronized once, on the step's last micro-batch.
"""

from __future__ import annotations

import contextlib
import math

import torch
from common import model_and_shards, parser


def main() -> None:
    p = parser(__doc__)
    args = p.parse_args()
    with model_and_shards(args, p) as (folder, shards):
        train(folder, shards, args)


def train(folder: str, shards: str, args) -> None:
    from accelerate import Accelerator
    from transformers import AutoModelForImageTextToText

    from vlmshard.shards.loader import make_loader
    from vlmshard.shards.model_inputs import model_inputs, supervised_tokens

    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    model = AutoModelForImageTextToText.from_pretrained(
        folder, dtype=torch.float32 if accelerator.device.type == "cpu" else torch.bfloat16,
        attn_implementation=args.attn)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    model, optimizer = accelerator.prepare(model, optimizer)
    plain = accelerator.unwrap_model(model)  # its config says the attention implementation
    loader = make_loader(shards, accelerator.process_index, accelerator.num_processes,
                         pad_to_caps=False)
    per_step = loader.dataset.micro_batches_per_step
    steps = min(args.steps, loader.dataset.steps)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, s + 1) * 0.5 * (1 + math.cos(math.pi * s / steps)))
    model.train()
    batches = iter(loader)
    for step in range(steps):
        micro = [next(batches) for _ in range(per_step)]
        tokens = torch.tensor(float(sum(supervised_tokens(b) for b in micro)),
                              device=accelerator.device)
        tokens = accelerator.reduce(tokens, "sum") / accelerator.num_processes
        total = 0.0
        for k, batch in enumerate(micro):
            last = k == per_step - 1
            with contextlib.nullcontext() if last else accelerator.no_sync(model):
                loss = model(**model_inputs(batch, plain, num_items_in_batch=tokens)).loss
                accelerator.backward(loss)
            total += loss.item()
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        accelerator.print(f'{{"step": {step}, "loss": {total:.5f}}}')


if __name__ == "__main__":
    main()
