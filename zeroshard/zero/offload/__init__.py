"""Where a rank's model states live between uses: the offload policy (policy.py), and the NVMe
home: asynchronous file I/O (nvme_io.py), the swapped Adam (nvme_swap.py) and its torch-facing
optimizer (nvme_optim.py), stage-3 parameter shards in a memory-mapped file (nvme_params.py),
and the `zeroshard bench-io` measurement (nvme_bench.py).

Below the strategies of zero/, which ask the policy where a state lives. Imports nothing of ours
but `config` types and `errors`.
"""
