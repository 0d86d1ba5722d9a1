from deepspeed.checkpoint import utils  # noqa: F401
