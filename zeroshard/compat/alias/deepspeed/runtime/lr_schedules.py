"""deepspeed.runtime.lr_schedules -> zeroshard.runtime.lr_schedules (same class names)."""

from zeroshard.compat._names import reexport as _reexport

_NAMES = ["VALID_LR_SCHEDULES", "LR_RANGE_TEST", "ONE_CYCLE", "WARMUP_LR", "WARMUP_DECAY_LR",
          "WARMUP_COSINE_LR", "LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR",
          "WarmupCosineLR"]
__getattr__, __dir__ = _reexport(__name__, {n: f"zeroshard.runtime.lr_schedules:{n}" for n in _NAMES})

# DeepSpeed's names of the schedulers' `params` keys (scripts build param dicts with them).
LR_SCHEDULE = "lr_schedule"
LR_RANGE_TEST_MIN_LR = "lr_range_test_min_lr"
LR_RANGE_TEST_STEP_RATE = "lr_range_test_step_rate"
LR_RANGE_TEST_STEP_SIZE = "lr_range_test_step_size"
LR_RANGE_TEST_STAIRCASE = "lr_range_test_staircase"
EDGE_VALUE = "edge_value"
MID_VALUE = "mid_value"
CYCLE_FIRST_STEP_SIZE = "cycle_first_step_size"
CYCLE_FIRST_STAIR_COUNT = "cycle_first_stair_count"
CYCLE_SECOND_STEP_SIZE = "cycle_second_step_size"
CYCLE_SECOND_STAIR_COUNT = "cycle_second_stair_count"
DECAY_STEP_SIZE = "decay_step_size"
CYCLE_MIN_LR = "cycle_min_lr"
CYCLE_MAX_LR = "cycle_max_lr"
DECAY_LR_RATE = "decay_lr_rate"
CYCLE_MIN_MOM = "cycle_min_mom"
CYCLE_MAX_MOM = "cycle_max_mom"
DECAY_MOM_RATE = "decay_mom_rate"
WARMUP_MIN_LR = "warmup_min_lr"
WARMUP_MAX_LR = "warmup_max_lr"
WARMUP_NUM_STEPS = "warmup_num_steps"
WARMUP_TYPE = "warmup_type"
WARMUP_LOG_RATE = "log"
WARMUP_LINEAR_RATE = "linear"
WARMUP_MIN_RATIO = "warmup_min_ratio"
COS_MIN_RATIO = "cos_min_ratio"
TOTAL_NUM_STEPS = "total_num_steps"
