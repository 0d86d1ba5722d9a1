"""deepspeed.compression: only `helper`, whose attribute-path functions scripts import even
without compression (DeepSpeed-Chat's LoRA module); compression training itself is not modelled."""

from deepspeed.compression import helper

__all__ = ["helper"]
