"""deepspeed.ops.op_builder: DeepSpeed's builders of compiled ops, by name only.

zeroshard compiles no ops (its CPU Adam, fused Adam and LAMB run on torch's kernels, NVMe I/O on
its own Python reader). Code reads a builder's `NAME` to look it up in
`deepspeed.ops.__compatible_ops__`; building or loading one is refused by name.
"""

from zeroshard.compat.refused import refused_class as _refused

_INSTEAD = ("zeroshard compiles no ops; the feature it backs runs on torch's kernels (see "
            "deepspeed.ops.__compatible_ops__ for what zeroshard provides)")

OpBuilder = _refused("deepspeed.ops.op_builder.OpBuilder", _INSTEAD, NAME="op_builder")
CPUAdamBuilder = _refused("deepspeed.ops.op_builder.CPUAdamBuilder", _INSTEAD, NAME="cpu_adam")
CPUAdagradBuilder = _refused("deepspeed.ops.op_builder.CPUAdagradBuilder", _INSTEAD, NAME="cpu_adagrad")
CPULionBuilder = _refused("deepspeed.ops.op_builder.CPULionBuilder", _INSTEAD, NAME="cpu_lion")
FusedAdamBuilder = _refused("deepspeed.ops.op_builder.FusedAdamBuilder", _INSTEAD, NAME="fused_adam")
FusedLambBuilder = _refused("deepspeed.ops.op_builder.FusedLambBuilder", _INSTEAD, NAME="fused_lamb")
AsyncIOBuilder = _refused("deepspeed.ops.op_builder.AsyncIOBuilder", _INSTEAD, NAME="async_io")

__all__ = ["OpBuilder", "CPUAdamBuilder", "CPUAdagradBuilder", "CPULionBuilder", "FusedAdamBuilder",
           "FusedLambBuilder", "AsyncIOBuilder"]
