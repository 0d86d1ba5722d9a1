from deepspeed.ops import adagrad, adam, lion  # noqa: F401
