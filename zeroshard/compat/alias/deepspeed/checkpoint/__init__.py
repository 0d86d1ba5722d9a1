from deepspeed.checkpoint import utils
