"""deepspeed.runtime.pipe.schedule: DeepSpeed's own pipeline instruction schedules, by name only.

zeroshard's pipeline engine runs torch's schedules (`pipeline.schedule`: "1F1B", "GPipe",
"Interleaved1F1B", ... from torch.distributed.pipelining), not DeepSpeed's instruction lists, so
building one of these classes (Megatron-DeepSpeed builds `TrainSchedule` for its zero-bubble
option) is refused by name."""

from zeroshard.compat.refused import refused_class as _refused

_INSTEAD = ('zeroshard runs torch.distributed.pipelining schedules; choose one with the config key '
            '"pipeline": {"schedule": "1F1B"} (README, pipeline parallelism)')
_NAMES = ["PipeSchedule", "TrainSchedule", "InferenceSchedule", "DataParallelSchedule", "DualPipeVSchedule",
          "PipeInstruction", "OptimizerStep", "ReduceGrads", "ReduceTiedGrads", "BufferOpInstruction",
          "LoadMicroBatch", "ForwardPass", "BackwardPass", "SendActivation", "RecvActivation", "SendGrad",
          "RecvGrad", "CommitP2P"]
globals().update({_n: _refused(f"deepspeed.runtime.pipe.schedule.{_n}", _INSTEAD) for _n in _NAMES})
__all__ = list(_NAMES)
