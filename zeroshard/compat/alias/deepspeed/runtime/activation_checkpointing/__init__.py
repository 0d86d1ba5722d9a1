from deepspeed.runtime.activation_checkpointing import checkpointing  # noqa: F401
