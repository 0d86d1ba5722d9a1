"""deepspeed.runtime.config: `DeepSpeedConfig` over zeroshard's Config, `get_gradient_clipping`,
and DeepSpeed's optimizer-name constants (the `optimizer.type` values, lower-cased)."""

from zeroshard.compat.ds_config import DeepSpeedConfig, get_gradient_clipping
from zeroshard.errors import ConfigError as DeepSpeedConfigError

ADAGRAD_OPTIMIZER = "adagrad"
ADAM_OPTIMIZER = "adam"
ADAMW_OPTIMIZER = "adamw"
LAMB_OPTIMIZER = "lamb"
ONEBIT_ADAM_OPTIMIZER = "onebitadam"
ZERO_ONE_ADAM_OPTIMIZER = "zerooneadam"
ONEBIT_LAMB_OPTIMIZER = "onebitlamb"
LION_OPTIMIZER = "lion"

__all__ = ["DeepSpeedConfig", "DeepSpeedConfigError", "get_gradient_clipping", "ADAGRAD_OPTIMIZER",
           "ADAM_OPTIMIZER", "ADAMW_OPTIMIZER", "LAMB_OPTIMIZER", "ONEBIT_ADAM_OPTIMIZER",
           "ZERO_ONE_ADAM_OPTIMIZER", "ONEBIT_LAMB_OPTIMIZER", "LION_OPTIMIZER"]
