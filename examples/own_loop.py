"""Train on vlmshard shards with a plain PyTorch loop and a Hugging Face model.

    python examples/own_loop.py --shards out/shards --model /models/InternVL3-1B-hf --steps 100
    python examples/own_loop.py --smoke            # a tiny demo model and shards, 2 CPU steps
    python examples/own_loop.py --smoke --check    # one JSON line: packed vs each sample alone

Each step takes the loader's micro-batches of that step (the plan's micro-batches of every
virtual rank this rank serves), sums their token losses and divides by the step's supervised
tokens (Ave-Token, as ``vlmshard train``), then steps the optimizer once. ``model_inputs`` keeps
the packed samples apart for the model's attention implementation. Under DDP, all-reduce the
step's token count and divide it by the world size before passing it (see the README).

``--check`` runs the first micro-batch packed and each of its samples alone through the model's
own forward (its own position ids and causal mask) and prints the largest logit difference.
"""

from __future__ import annotations

import json
import math

import torch
from common import model_and_shards, parser


def load_model(folder: str, attn: str, device: str):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(
        folder, dtype=torch.float32 if device == "cpu" else torch.bfloat16,
        attn_implementation=attn).to(device)


def check(model, shards: str) -> dict:
    """Packed logits (with ``model_inputs``) against each sample run alone."""
    from vlmshard.shards.loader import ShardDataset
    from vlmshard.shards.model_inputs import model_inputs, split_batch, token_types

    model.eval()
    batch = max((b for _, b in zip(range(8), ShardDataset(shards))),
                key=lambda b: b["num_samples"])
    device = next(model.parameters()).device
    with torch.no_grad():
        packed = model(**model_inputs(batch, model)).logits[0].float()
        diff, start = 0.0, 0
        for sample in split_batch(batch, model):  # the model says where video pixels go
            visual = sample.pop("image_token_mask")
            inputs = {k: v.to(device) for k, v in sample.items()}
            if "image_grid_thw" in inputs or "video_grid_thw" in inputs:  # Qwen's mRoPE
                inputs["mm_token_type_ids"] = token_types(model, sample["input_ids"],
                                                          visual).to(device)
            alone = model(**inputs, use_cache=False).logits[0].float()
            n = alone.shape[0]
            diff = max(diff, float((packed[start:start + n] - alone).abs().max()))
            start += n
    return {"max_abs_diff": diff, "samples": batch["num_samples"], "tokens": batch["num_tokens"]}


def train(model, shards: str, steps: int, lr: float, warmup: int) -> None:
    from vlmshard.shards.loader import make_loader
    from vlmshard.shards.model_inputs import model_inputs, supervised_tokens

    loader = make_loader(shards, rank=0, world_size=1, pad_to_caps=False)
    per_step = loader.dataset.micro_batches_per_step
    steps = min(steps, loader.dataset.steps)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup)
                                                 * 0.5 * (1 + math.cos(math.pi * s / steps)))
    model.train()
    batches = iter(loader)
    for step in range(steps):
        micro = [next(batches) for _ in range(per_step)]
        tokens = sum(supervised_tokens(b) for b in micro)  # DDP: all-reduce, / world size
        total = 0.0
        for batch in micro:
            loss = model(**model_inputs(batch, model, num_items_in_batch=tokens)).loss
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        print(json.dumps({"step": step, "loss": round(total, 5), "tokens": tokens,
                          "micro_batches": per_step}), flush=True)


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--check", action="store_true", help="print packed vs alone, do not train")
    p.add_argument("--warmup", type=int, default=1, help="linear warm-up steps, then cosine")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()
    with model_and_shards(args, p) as (folder, shards):
        model = load_model(folder, args.attn, args.device)
        if args.check:
            print(json.dumps(check(model, shards)))
        else:
            train(model, shards, args.steps, args.lr, args.warmup)


if __name__ == "__main__":
    main()
