"""deepspeed.ops.aio: `AsyncIOBuilder`, by name only (zeroshard's NVMe offload needs no compiled op)."""

from deepspeed.ops.op_builder import AsyncIOBuilder

__all__ = ["AsyncIOBuilder"]
