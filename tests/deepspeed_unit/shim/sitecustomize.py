"""Loaded by every Python process of a shimmed run (this folder is on PYTHONPATH only then).

When ZEROSHARD_AS_DEEPSPEED=1, the first `import deepspeed` is followed by
`zs_as_deepspeed.patch()`, which points DeepSpeed's public entry points at zeroshard. It has to
happen in every process, not only in pytest's: DeepSpeed's DistributedTest starts its ranks
with the forkserver method, and each rank imports the test module afresh.
"""

import os

if os.environ.get("ZEROSHARD_AS_DEEPSPEED") == "1":
    import zs_as_deepspeed

    zs_as_deepspeed.install_hook()
