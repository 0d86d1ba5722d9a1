from deepspeed.launcher import runner
