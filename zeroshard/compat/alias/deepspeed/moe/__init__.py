from deepspeed.moe import utils  # noqa: F401
