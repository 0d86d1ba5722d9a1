"""deepspeed.launcher.runner: the environment-file name the launcher exports to workers."""

DEEPSPEED_ENVIRONMENT_NAME = ".deepspeed_env"
