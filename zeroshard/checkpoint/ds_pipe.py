"""DeepSpeed 0.19's pipeline checkpoints seen as one source per pipeline stage (checkpoint/pipe_files.py)."""
