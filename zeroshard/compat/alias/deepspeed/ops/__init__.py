from deepspeed.ops import adagrad, adam, lion
