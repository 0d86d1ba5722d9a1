"""DeepSpeed's `deepspeed.runtime.zero.*` module paths, as aliases onto zeroshard's own code.

Scripts import estimators and stage-3 helpers by these paths (`deepspeed.runtime.zero.stage3.
estimate_zero3_model_states_mem_needs_all_live`, `...partition_parameters.ZeroParamStatus`);
nothing here is implemented twice. Outside the layering: a facade for ported imports only.
"""
