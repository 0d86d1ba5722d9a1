"""deepspeed.runtime.swap_tensor: DeepSpeed's NVMe tensor swapper. zeroshard's NVMe offload is
zero/offload/ (nvme_io.py, nvme_swap.py, nvme_params.py); only DeepSpeed's size constant is here.

`MIN_SWAPPABLE_BYTES` is DeepSpeed 0.19.8's smallest tensor it swaps (its `MIN_AIO_BYTES`,
1 MiB); DeepSpeed's tests size their models by it. zeroshard's swap files take tensors of any size,
so nothing in zeroshard reads it.
"""

MIN_SWAPPABLE_BYTES = 1024**2

__all__ = ["MIN_SWAPPABLE_BYTES"]
