"""Activation memory of a transformer's training step, per device.

Source: Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models"
(2022), section 4: one layer stores s*b*h*(34 + 5*a*s/h) bytes with 16-bit activations and
dropout (s sequence, b micro batch, h hidden, a heads). We keep their term-by-term count so
that it follows the options: the 34 is 16 elements of 2 bytes (attention 5, MLP 1 + 2*ffn/h,
layer norms 2) plus 2 one-byte dropout masks; the 5*a*s/h is the softmax output, its dropout
output and mask, which an SDPA / flash kernel does not store. Full activation checkpointing
keeps each layer's input (2*s*b*h) and recomputes one layer at a time. The output head adds
its logits, the fp32 copy the loss upcasts, and that copy's gradient.

Tensor parallelism (their section 4.1, Megatron's layout) splits the tensors inside the attention
and MLP regions over `tp` ranks (Q, K, V, the output projection's input, the MLP's inner tensors,
the scores, the vocabulary-parallel logits) and leaves the rest replicated: the two layer-norm
inputs, the two region inputs and the two dropout masks, 10 of the 34 bytes. Sequence
parallelism (section 4.2.2) cuts those along the sequence too, so everything is divided by `tp`.
DeepSpeed-Ulysses / ring sequence parallelism over `sp` ranks (zeroshard/sequence/) is another axis:
every tensor a layer stores holds 1/sp of the sequence (inside Ulysses' attention, the whole
sequence for 1/sp of the heads: the same count; a stored score matrix is s x s for 1/sp of the heads),
and so do the logits; `tiled_logits` (TiledFusedLogitsLoss) keeps only the hidden states' gradient
instead of the logits. A pipeline stage keeps several micro-batches' activations at once: `in_flight`
gives how many per schedule. Imports nothing of ours but `estimate.spec`. Worked examples in docs/estimate.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

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
    tp: int = 1
    """Tensor-parallel size: the attention / MLP tensors and the logits are split over `tp` ranks."""
    sequence_parallel: bool = False
    """With tp > 1: the norms' and dropouts' tensors are cut along the sequence as well."""
    sp: int = 1
    """Ulysses / ring sequence-parallel size: each rank stores 1/sp of every activation."""
    tiled_logits: bool = False
    """The loss from hidden states tile by tile (TiledFusedLogitsLoss): no [s, vocab] logits kept,
    only the hidden states' gradient (s*b*h fp32) computed in the forward."""

    def __post_init__(self) -> None:
        if self.sp < 1 or self.seq_len % self.sp:
            raise ValueError(f"sequence-parallel size {self.sp} must divide the sequence length {self.seq_len}")


@lru_cache(maxsize=4096)
def layer_bytes(shape: TransformerShape, opt: ActivationOptions) -> int:
    """Activations one transformer layer keeps for backward (Korthikanti et al., eq. 1)."""
    s, b, h, a = opt.seq_len // opt.sp, opt.micro_batch, shape.hidden_size, shape.num_heads
    sbh = s * b * h
    t = max(1, opt.tp)
    ffn_elems = s * b * shape.ffn_hidden_size * (3 if shape.gated_mlp else 2)
    kv = 2 * sbh * (shape.num_kv_heads or a) // a
    # Split over tp: Q, K, V and the output projection's input; the MLP's activation input and
    # second linear's input (a gated MLP keeps one more). Replicated unless sequence parallel:
    # the attention's and the MLP's inputs (LN outputs), the two layer-norm inputs, the masks.
    split = 2 * sbh + kv + ffn_elems
    replicated = 4 * sbh
    masks = 2 * sbh if opt.dropout else 0
    if opt.sequence_parallel and t > 1:
        replicated, masks = -(-replicated // t), -(-masks // t)
    scores = 0
    if not opt.flash_attention or shape.attention_scores_stored:
        per = a * s * opt.seq_len * b  # the whole sequence's scores for 1/sp of the heads
        scores = opt.act_bytes * per * (2 if opt.dropout else 1) + (per if opt.dropout else 0)
    return opt.act_bytes * (-(-split // t) + replicated) + masks + -(-scores // t)


def head_bytes(shape: TransformerShape, opt: ActivationOptions) -> int:
    """Logits (activation dtype), the loss's fp32 copy and its gradient: s*b*V*(act + 4 + 4)."""
    s = opt.seq_len // opt.sp
    if opt.tiled_logits:
        return s * opt.micro_batch * shape.hidden_size * 4
    svb = -(-s * opt.micro_batch * shape.vocab_size // max(1, opt.tp))  # vocabulary-parallel logits
    upcast = 4 if opt.act_bytes < 4 else 0
    return svb * (opt.act_bytes + upcast + 4)


def embed_bytes(shape: TransformerShape, opt: ActivationOptions) -> int:
    """One layer's input (the residual stream): s*b*h, cut by tp under sequence parallelism."""
    sbh = opt.act_bytes * (opt.seq_len // opt.sp) * opt.micro_batch * shape.hidden_size
    return -(-sbh // opt.tp) if opt.sequence_parallel and opt.tp > 1 else sbh


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
    return stage_activation_bytes(shape, opt, shape.num_layers, first=True, last=True)


def stage_activation_bytes(shape: TransformerShape, opt: ActivationOptions, layers: float, *, first: bool,
                           last: bool, in_flight: float = 1.0, head_in_flight: float = 1.0) -> int:
    """Peak activation bytes of one pipeline stage holding `layers` transformer layers.

    `in_flight` micro-batches are stored at once (see `in_flight`; 1 without a pipeline), each
    keeping `layers` layers' activations (their inputs only under checkpointing, plus one layer
    recomputed in backward); the first stage adds the embedding output per micro-batch, the last
    the head's logits for `head_in_flight` micro-batches (the loss runs inside the last stage's
    forward, so GPipe keeps all m of them, 1F1B one).
    """
    embed = embed_bytes(shape, opt)
    per_layer = embed if opt.checkpointing else layer_bytes(shape, opt)
    body = in_flight * (layers * per_layer + (embed if first else 0))
    recompute = layer_bytes(shape, opt) if opt.checkpointing and layers > 0 else 0
    return int(body + recompute + (head_in_flight * head_bytes(shape, opt) if last else 0))


Schedule = str
"""A pipeline schedule name as the `pipeline.schedule` key takes it (pipe/schedules.py)."""

SCHEDULES: tuple[str, ...] = ("1f1b", "gpipe", "interleaved_1f1b", "interleaved_zero_bubble")


def in_flight(schedule: Schedule, stages: int, stage: int, micro_batches: int, virtual: int = 1) -> float:
    """Micro-batches whose activations stage `stage` of `stages` holds at its peak, in units of
    the whole stage's layers (a chunk of an interleaved stage counts 1 / virtual).

    - gpipe: every forward before any backward: all m.
    - 1f1b (and a pipeline of one stage): stage s warms up with p - s forwards, then alternates
      one forward with one backward: min(p - s, m).
    - interleaved_1f1b, interleaved_zero_bubble (torch's schedules, v chunks per rank): rank s
      warms up with (v - 1) * p + 2 * (p - 1 - s) chunk forwards and keeps one more in flight,
      capped at the v * m chunks of a batch; at pipeline stage 0 that is p * (1 + (p - 1) / (p v)) micro-batches,
      Narayanan et al.'s (2021) memory factor. The zero-bubble variant defers weight gradients but
      keeps the same forward order, so its count is the interleaved one (an approximation: W ops
      hold their inputs a little longer).
    """
    if stages < 1 or not 0 <= stage < stages or micro_batches < 1 or virtual < 1:
        raise ValueError(f"stage {stage} of {stages}, {micro_batches} micro-batches, {virtual} virtual stages")
    if schedule == "gpipe":
        return float(micro_batches)
    if schedule == "1f1b" or stages == 1:
        return float(min(stages - stage, micro_batches))
    if schedule in ("interleaved_1f1b", "interleaved_zero_bubble"):
        chunks = (virtual - 1) * stages + 2 * (stages - 1 - stage) + 1
        return min(chunks, virtual * micro_batches) / virtual
    raise ValueError(f"pipeline schedule {schedule!r}: expected one of {', '.join(SCHEDULES)}")


def bubble_fraction(schedule: Schedule, stages: int, micro_batches: int, virtual: int = 1) -> float:
    """Idle time per unit of compute: (p - 1) / m for GPipe and 1F1B, (p - 1) / (v m) interleaved;
    the interleaved zero-bubble schedule fills most of it with weight-gradient passes: a third of the
    interleaved figure, as ZB-H1 against 1F1B (Qi et al., 2023), not its ideal 0."""
    if stages == 1:
        return 0.0
    base = (stages - 1) / micro_batches
    if schedule in ("gpipe", "1f1b"):
        return base
    if schedule == "interleaved_1f1b":
        return base / virtual
    if schedule == "interleaved_zero_bubble":
        return base / (3 * virtual)
    raise ValueError(f"pipeline schedule {schedule!r}: expected one of {', '.join(SCHEDULES)}")
