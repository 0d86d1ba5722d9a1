"""deepspeed.runtime: the engine, lr schedules and ZeRO modules, mapped onto zeroshard."""

from deepspeed.runtime import activation_checkpointing, engine, lr_schedules, utils, zero
