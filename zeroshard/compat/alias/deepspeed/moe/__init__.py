from deepspeed.moe import utils
