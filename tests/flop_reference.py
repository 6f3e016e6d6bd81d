"""The FLOPs the ``transformers`` model runs for a step's samples, counted by torch's
``FlopCounterMode``, set beside the train log's ``model_flops`` for the same samples.

Each sample of the step's micro-batches goes through the HF model alone (``hf_reference``'s
split), forward and backward, every parameter training, the LM head on the supervised rows only
(``logits_to_keep`` given their indices: the trainer's ``lm_loss`` does the same), attention
and a MoE layer's experts ``eager`` so that their products are matmuls the counter sees
(``torch._grouped_mm``, the experts' default, it does not count). Two differences from the trainer
are taken out of the count, each on purpose in the analytic model:

- a causal attention kernel computes half the (query, key) pairs a dense one does (flash and
  varlen kernels skip the masked blocks): the counted products of each LLM attention layer are
  scaled by the pairs the analytic model charges, seq_len² (of the dense 2·seq_len²) for full
  attention, m·(2·seq_len − m) for a window m = min(seq_len, w);
- the Gated DeltaNet's chunked rule (Qwen3.5's linear attention) runs each sample rounded up
  to whole chunks of ``DELTA_CHUNK`` tokens, which the analytic model does not count (the
  rounding is the kernel's, not the sample's work): the counted products of each
  linear-attention layer's rule are scaled by seq_len over its rounded length;
- elementwise work (norms, activations, softmax, rotary, the loss) is not counted by the counter
  and not by the model.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from hf_reference import split_samples, with_token_types

IGNORE_INDEX = -100
MATMULS = {"bmm", "baddbmm"}  # eager attention's q·kᵀ and p·v (linear layers are mm/addmm)
DELTA_CHUNK = 64  # transformers' torch_chunk_gated_delta_rule's chunk_size


def _linear_attention_layers(model) -> list[str]:
    """The LLM's Gated DeltaNet modules by qualified name."""
    return [name for name, _ in model.named_modules()
            if "language_model" in name.split(".") and name.endswith("linear_attn")]


def _attention_layers(model) -> dict[str, int | None]:
    """The LLM's attention modules by qualified name, each with its sliding window (None:
    full attention)."""
    text = model.config.get_text_config()
    types = getattr(text, "layer_types", None) or []
    window = getattr(text, "sliding_window", None)
    out = {}
    for name, module in model.named_modules():
        parts = name.split(".")
        if "language_model" not in parts or not name.endswith("self_attn"):
            continue
        layer = int(parts[parts.index("layers") + 1])
        sliding = layer < len(types) and types[layer] == "sliding_attention"
        out[name] = window if sliding else None
    return out


def _pair_share(length: int, window: int | None) -> float:
    """The analytic model's (query, key) pairs of a sample over the dense kernel's."""
    if window is None or length <= window:
        return 0.5
    m = window
    return m * (2 * length - m) / (2 * length * length)


def hf_step_flops(folder: str, batches: list[dict], tokens_per_tile: int,
                  rows_per_tile: int) -> dict[str, float]:
    """``counted``: the FlopCounterMode total over the step's samples, forward and backward;
    ``attention``: of it, the LLM attention layers' dense products and the delta rules' on
    whole chunks; ``reference``: the count with those at the analytic model's pairs and the
    samples' own lengths (module docstring)."""
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32,
                                                        attn_implementation="eager",
                                                        experts_implementation="eager")
    model.train()
    forward = type(model).forward
    attention = _attention_layers(model)
    delta_rules = _linear_attention_layers(model)
    image_token_id = model.config.image_token_id
    video_token_id = getattr(model.config, "video_token_id", None)
    counted = dense = kept = 0.0
    for batch in batches:
        samples = with_token_types(model, split_samples(batch, image_token_id, tokens_per_tile,
                                                        rows_per_tile, video_token_id))
        for sample in samples:
            if "second_per_grid_ts" not in inspect.signature(forward).parameters:
                sample.pop("second_per_grid_ts", None)
            labels = sample.pop("labels")[0]
            targets = torch.full_like(labels, IGNORE_INDEX)
            targets[:-1] = labels[1:]
            rows = torch.nonzero(targets != IGNORE_INDEX).flatten()
            counter = FlopCounterMode(display=False)
            with counter:
                out = model(**sample, use_cache=False, logits_to_keep=rows)
                loss = F.cross_entropy(out.logits[0].float(), targets[rows], reduction="sum")
                loss.backward()
            model.zero_grad(set_to_none=True)
            counted += counter.get_total_flops()
            # the attention products by layer, from a forward alone (the counter names the
            # module of a forward op; a backward op's it may not): their backward is twice them
            forward_only = FlopCounterMode(display=False)
            with forward_only, torch.no_grad():
                model(**sample, use_cache=False, logits_to_keep=rows)
            counts = forward_only.get_flop_counts()
            length = labels.shape[0]
            for name, window in attention.items():
                ops = next((v for k, v in counts.items() if k.endswith(name)), {})
                products = 3 * sum(float(c) for op, c in ops.items()
                                   if str(op).split(".")[1] in MATMULS)
                dense += products
                kept += products * _pair_share(length, window)
            rounded = -(-length // DELTA_CHUNK) * DELTA_CHUNK
            for name in delta_rules:
                ops = next((v for k, v in counts.items() if k.endswith(name)), {})
                products = 3 * sum(float(c) for op, c in ops.items()
                                   if str(op).split(".")[1] in MATMULS)
                dense += products
                kept += products * length / rounded
    return {"counted": counted, "attention": dense, "reference": counted - dense + kept}
