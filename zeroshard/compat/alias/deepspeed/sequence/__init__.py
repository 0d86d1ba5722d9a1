"""deepspeed.sequence: sequence-parallel attention (`deepspeed.sequence.layer`), served by zeroshard.sequence."""
