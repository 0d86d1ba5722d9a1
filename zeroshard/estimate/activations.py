"""Activation memory of a transformer's training step, per device.

Source: Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models"
(2022), section 4: one layer stores s*b*h*(34 + 5*a*s/h) bytes with 16-bit activations and
dropout (s sequence, b micro batch, h hidden, a heads). We keep their term-by-term count so
that it follows the options: the 34 is 16 elements of 2 bytes (attention 5, MLP 1 + 2*ffn/h,
layer norms 2) plus 2 one-byte dropout masks; the 5*a*s/h is the softmax output, its dropout
output and mask, which an SDPA / flash kernel does not store. Full activation checkpointing
keeps each layer's input (2*s*b*h) and recomputes one layer at a time. The output head adds
its logits, the fp32 copy the loss upcasts, and that copy's gradient. Imports nothing of ours
but `estimate.spec`. Documented with a worked example in docs/estimate.md.
"""

from __future__ import annotations

from dataclasses import dataclass

from zeroshard.estimate.spec import TransformerShape


@dataclass(frozen=True, kw_only=True)
class ActivationOptions:
    """How the step runs: sequence length, micro batch and what is stored."""

    seq_len: int
    micro_batch: int
    checkpointing: bool = False
    """Full activation checkpointing: every layer recomputed in backward."""
    act_bytes: int = 2
    """Bytes per activation element: 2 under bf16/fp16, 4 in fp32."""
    dropout: bool = True
    """Dropout masks are stored (1 byte per element)."""
    flash_attention: bool = True
    """SDPA / flash attention: no s*s attention matrix is stored (unless the model's shape says
    it materialises the scores anyway)."""


def layer_bytes(shape: TransformerShape, opt: ActivationOptions) -> int:
    """Activations one transformer layer keeps for backward (Korthikanti et al., eq. 1)."""
    s, b, h, a = opt.seq_len, opt.micro_batch, shape.hidden_size, shape.num_heads
    sbh = s * b * h
    ffn_elems = s * b * shape.ffn_hidden_size * (3 if shape.gated_mlp else 2)
    # attention: LN output (QKV input), Q, K, V, output-projection input; MLP: input, then
    # the activation's input and the second linear's input (a gated MLP keeps one more);
    # two layer-norm inputs.
    elems = 5 * sbh + (sbh + ffn_elems) + 2 * sbh
    masks = 2 * sbh if opt.dropout else 0
    scores = 0
    if not opt.flash_attention or shape.attention_scores_stored:
        per = a * s * s * b
        scores = opt.act_bytes * per * (2 if opt.dropout else 1) + (per if opt.dropout else 0)
    return opt.act_bytes * elems + masks + scores


def head_bytes(shape: TransformerShape, opt: ActivationOptions) -> int:
    """Logits (activation dtype), the loss's fp32 copy and its gradient: s*b*V*(act + 4 + 4)."""
    svb = opt.seq_len * opt.micro_batch * shape.vocab_size
    upcast = 4 if opt.act_bytes < 4 else 0
    return svb * (opt.act_bytes + upcast + 4)


def activation_bytes(shape: TransformerShape, opt: ActivationOptions) -> int:
    """Peak activation bytes on one device for a micro batch.

    Without checkpointing: L * layer_bytes + embedding output + head. With it: every layer's
    input (L * s*b*h * act_bytes) plus one layer recomputed during backward, plus the head.

    Example:
        >>> shape = TransformerShape(hidden_size=1024, num_layers=24, num_heads=16,
        ...                          vocab_size=50257, ffn_hidden_size=4096)
        >>> opt = ActivationOptions(seq_len=1024, micro_batch=1, flash_attention=False)
        >>> activation_bytes(shape, opt) // 2**20  # MiB
        3228
    """
    embed = opt.act_bytes * opt.seq_len * opt.micro_batch * shape.hidden_size
    layer = layer_bytes(shape, opt)
    if opt.checkpointing:
        body = shape.num_layers * embed + layer
    else:
        body = shape.num_layers * layer
    return body + embed + head_bytes(shape, opt)
