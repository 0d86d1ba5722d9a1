"""deepspeed.ops.op_builder.builder: the module that defines DeepSpeed's `OpBuilder` base class
(Megatron-DeepSpeed's initialize.py imports it from here); the refused class of `op_builder`."""

from deepspeed.ops.op_builder import OpBuilder

__all__ = ["OpBuilder"]
