"""deepspeed.runtime.fp16: DeepSpeed's fp16 optimizer wrappers, by name only."""
