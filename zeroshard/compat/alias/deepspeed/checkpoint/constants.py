"""deepspeed.checkpoint.constants: the key names of DeepSpeed's checkpoint and universal-checkpoint
formats, as scripts import them (Megatron-DeepSpeed writes `universal_checkpoint_info` with the
pattern keys into its client state; its conversion tools read the optimizer-file keys). The values
are the strings DeepSpeed 0.19.8 writes to disk, which zeroshard's readers of those formats
(checkpoint/ds_files.py, ds_universal.py) and `zeroshard to-deepspeed` use too."""

# universal_checkpoint_info, the client-state entry Megatron-DeepSpeed saves for ds_to_universal
UNIVERSAL_CHECKPOINT_INFO = "universal_checkpoint_info"
UNIVERSAL_CHECKPOINT_VERSION_KEY = "universal_checkpoint_version"
UNIVERSAL_CHECKPOINT_VERSION_VALUE = 0.4
ORIGINAL_VOCAB_SIZE = "original_vocab_size"
PADDED_VOCAB_SIZE = "padded_vocab_size"
VOCABULARY_PARAMETER_PATTERNS = "vocabulary_parameter_patterns"
PIPELINE_REPLICATED_PARAMETER_PATTERNS = "pipeline_replicated_parameter_patterns"
TP_REPLICATED_PARAMETER_PATTERNS = "tp_replicated_parameter_patterns"
PARAMETER_TO_AVERAGE_PATTERNS = "parameter_to_average_patterns"
PARAMETER_WITH_ROW_PARALLELISM_PATTERNS = "parameter_with_row_parallelism_patterns"
PARAMETER_WITH_2_SUB_PARAMS_CAT_DIM_0 = "parameter_with_2_sub_params_cat_dim_0"
PARAMETER_WITH_SUB_PARAMS = "parameter_with_sub_params"
SUB_PARAMS_SHAPE = "sub_params_shape"

# ZeRO optimizer files (zero_pp_rank_*_optim_states.pt) and their universal form
OPTIMIZER_STATE_DICT = "optimizer_state_dict"
ZERO_STAGE = "zero_stage"
BASE_OPTIMIZER_STATE = "base_optimizer_state"
BASE_OPTIMIZER_STATE_STEP = "base_optimizer_state_step"
SINGLE_PARTITION_OF_FP32_GROUPS = "single_partition_of_fp32_groups"
PARAM_GROUPS = "param_groups"
PARAM_SLICE_MAPPINGS = "param_slice_mappings"
FP32_FLAT_GROUPS = "fp32_flat_groups"
FP32_GROUPS = "fp32_groups"
FP32_WEIGHT_KEY = "fp32"
PARTITION_COUNT = "partition_count"
GROUP_PADDINGS = "group_paddings"
LOSS_SCALER = "loss_scaler"
CLIP_GRAD = "clip_grad"
DS_VERSION = "ds_version"
BUFFER_NAMES = "buffer_names"
FROZEN_PARAM_SHAPES = "frozen_param_shapes"
FROZEN_PARAM_FRAGMENTS = "frozen_param_fragments"
PARAM_SHAPES = "param_shapes"
PARAM = "param"
CAT_DIM = "cat_dim"
PARAM_N_SUB_PARAMS = "param_n_sub_params"
SUB_PARAM_SHAPE = "sub_param_shape"
SUB_PARAM_SHARD_WIDTHS = "sub_param_shard_widths"
VOCAB_TENSOR = "vocab_tensor"

# file names
MODEL_FILE_PREFIX = "mp_rank_"
MODEL_FILE_SUFFIX = "_model_states.pt"
OPTIM_FILE_SUFFIX = "_optim_states.pt"
ZERO_FILE_PREFIX = "zero_pp_rank_"
BF16_ZERO_FILE_PREFIX = "bf16_" + ZERO_FILE_PREFIX
FP16_ZERO_FILE_PREFIX = "fp16_" + ZERO_FILE_PREFIX
LAYER_FILE_PREFIX = "layer_"
