from deepspeed.launcher import runner  # noqa: F401
