"""A DeepSpeed-style script that creates its own process group before zeroshard.initialize."""

import atexit

import torch
import torch.distributed as dist

import zeroshard
from zeroshard.examples.gpt import GPT, GPTConfig

dist.init_process_group("gloo")
# Registered before zeroshard's own exit hook, so it runs after it: the script's group must be
# gone by then, not left to interpreter finalization (where gloo's threads can SIGABRT a rank).
atexit.register(lambda: print(f"GROUP-LEFT-AT-EXIT {not dist.is_initialized()}", flush=True))
group = dist.group.WORLD
torch.manual_seed(0)
model = GPT(GPTConfig.preset("tiny"))
config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
engine, *_ = zeroshard.initialize(model=model, config=config)
groups = zeroshard.init_distributed()
assert groups.dp_group is group, "initialize must use the script's own group"
x = torch.randint(0, 256, (2, 16))
for _ in range(2):
    engine.backward(engine(x, x))
    engine.step()
print(f"EXISTING-GROUP OK rank {dist.get_rank()} world {groups.world_size} steps {engine.global_steps}", flush=True)
