"""Where a rank's model states live between uses: the offload policy (policy.py), and the NVMe
home: asynchronous file I/O (nvme_io.py), the swapped Adam (nvme_swap.py) and its torch-facing
optimizer (nvme_optim.py), stage-3 parameter shards in a memory-mapped file (nvme_params.py),
the `zeroshard bench-io` measurement (nvme_bench.py), and the optimizers that schedule a CPU
step: the delayed update (delayed_step.py) and ZenFlow (zenflow.py).

Below the strategies of zero/, which ask the policy where a state lives. Imports nothing of ours
but `config` types and `errors`.
"""
