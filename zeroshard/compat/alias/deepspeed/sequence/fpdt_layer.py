"""deepspeed.sequence.fpdt_layer: DeepSpeed's FPDT (fully pipelined distributed transformer) layers,
by name only. Megatron-DeepSpeed imports them at module level; building one is refused by name:
zeroshard's long-sequence path is Ulysses / ALST sequence parallelism (deepspeed.sequence.layer,
deepspeed.runtime.sequence_parallel.ulysses_sp) and its ring attention (README, sequence parallelism)."""

from zeroshard.compat.refused import refused_class as _refused

_INSTEAD = ("use Ulysses/ALST sequence parallelism (deepspeed.sequence.layer.DistributedAttention, "
            "\"sequence_parallel_size\") or zeroshard's ring attention (zeroshard.sequence)")
_NAMES = ["FPDT_InputConstruct", "FPDT_Attention", "FPDT_FFN", "FPDT_LogitsLoss", "SequenceChunk"]
globals().update({_n: _refused(f"deepspeed.sequence.fpdt_layer.{_n}", _INSTEAD) for _n in _NAMES})
__all__ = list(_NAMES)
