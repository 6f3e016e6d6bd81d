"""The LLM's last pipeline layer: the final norm, the LM head and the loss, whose logits exist
only for supervised tokens, ``LOSS_CHUNK`` rows at a time, their gradients computed in the
forward (``vlmshard.train``'s ``lm_loss``, fused as Liger's linear + cross entropy)."""

from __future__ import annotations

from .configs import LLMConfig
from .embedding import tied_table_params
from .memory import FP32, INT64, LOSS_SCALE_BLOCK, Saves, rms_norm_backward, rms_norm_kept
from .work import LayerWork, CostTerms

# What the loss keeps per supervised token beyond its hidden state's gradient: the row's int64
# index (``nonzero_static``), which gathering the rows keeps for its backward
SUPERVISED_ROW_BYTES = INT64


def final_norm(t: LLMConfig, saves: Saves) -> LayerWork:
    """The final norm: its output, that output's gradient and the input's, and the fp32
    gradients of its backward."""
    a = saves.element_bytes
    normalized = 0 if saves.liger_llm else (FP32 if t.offset_norms else a)
    return LayerWork("final_norm", t.hidden, CostTerms(),
                     CostTerms(tokens=rms_norm_kept(t.hidden, a, offset=t.offset_norms,
                                                    fused=saves.liger_llm)),
                     CostTerms(tokens=a * t.hidden),
                     transient_bytes=CostTerms(tokens=3 * a * t.hidden
                                          + rms_norm_backward(t.hidden)),
                     weight_only_bytes=CostTerms(tokens=normalized * t.hidden))


def head(t: LLMConfig, saves: Saves) -> LayerWork:
    """The final norm and the LM head with its loss. Its FLOPs are the logits of the supervised
    tokens only (``CostTerms.supervised``): ``lm_loss`` selects their rows before the matmul.
    Keeps per supervised token the gradient the loss computed for its hidden state (in the
    run's dtype) and the row's index, charged here per token (``CostTerms.tokens``: the most
    there can be, as a memory plan at the caps must; the profile sizes it at the supervised
    count, ``train.profile.kept_size``). Holds the final norm's backward, per row
    of a loss chunk and class the fp32 logits (their log-softmax and gradient made in place) and,
    below fp32, the logits or their gradient in the run's dtype beside them; in backward a block
    of the weight's gradient made fp32 to be scaled (its gradient itself is counted with the
    parameters). A bound held at or above torch's memory tracker by tests/test_model.py."""
    norm = final_norm(t, saves)
    low = saves.element_bytes != FP32  # the logits are cast up, their gradient down
    scaled = FP32 * min(LOSS_SCALE_BLOCK, t.hidden * t.vocab_size) if low else 0
    return LayerWork(
        "head", t.hidden * t.vocab_size + t.hidden,
        flops=CostTerms(supervised=2 * t.hidden * t.vocab_size),
        activation_bytes=CostTerms(tokens=saves.element_bytes * t.hidden + SUPERVISED_ROW_BYTES
                              + norm.activation_bytes.tokens),
        output_bytes=CostTerms(),
        transient_bytes=norm.transient_bytes,
        chunk_row_bytes=(FP32 + saves.element_bytes * low) * t.vocab_size,
        fixed_transient_bytes=scaled,
        tied_params=tied_table_params(t), gradients_in_forward=True)
