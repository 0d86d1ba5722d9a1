"""deepspeed.runtime.sequence_parallel: ALST's sequence-parallel state (`parallel_state_sp`), served by
zeroshard.sequence."""
