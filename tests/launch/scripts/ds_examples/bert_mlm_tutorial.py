"""In the style of DeepSpeedExamples' HelloDeepSpeed (training/HelloDeepSpeed/train_bert_ds.py), written
anew: a tiny RoBERTa masked-LM built from a config, a synthetic token stream masked at random by the
data iterator, which is seeded and built BEFORE `load_checkpoint` (so a load that touched the
random generators would change the masks), checkpoints with `client_state={"checkpoint_step": N}`.

    torchrun --nproc-per-node=2 bert_mlm_tutorial.py --dtype bf16 --zero_stage 2 --out DIR --phase save|resume
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Iterator

import numpy as np
import torch
from common import check_framework, import_deepspeed, record_losses

deepspeed = import_deepspeed()

VOCAB, MASK_ID, PAD_ID, SEQ = 96, 4, 1, 24


def create_data_iterator(batch_size: int, mask_prob: float, rank: int) -> Iterator[dict[str, torch.Tensor]]:
    """Endless masked batches; the text is fixed, the masks come from the global torch generator."""
    g = torch.Generator().manual_seed(7 + rank)
    while True:
        ids = torch.randint(5, VOCAB, (batch_size, SEQ), generator=g)
        mask = torch.rand(ids.shape) < mask_prob  # the script's generator, seeded before the load
        labels = torch.where(mask, ids, torch.full_like(ids, -100))
        yield {"input_ids": torch.where(mask, torch.full_like(ids, MASK_ID), ids),
               "attention_mask": torch.ones_like(ids), "labels": labels}


def create_model() -> torch.nn.Module:
    from transformers import RobertaConfig, RobertaForMaskedLM

    config = RobertaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=64, max_position_embeddings=SEQ + 4, pad_token_id=PAD_ID,
                           hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
    return RobertaForMaskedLM(config)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--out", required=True)
    parser.add_argument("--phase", choices=("save", "resume"), required=True)
    parser.add_argument("--dtype", choices=("fp32", "fp16", "bf16"), default="bf16")
    parser.add_argument("--zero_stage", type=int, default=1)
    parser.add_argument("--num_iterations", type=int, default=6)
    parser.add_argument("--checkpoint_every", type=int, default=3)
    parser.add_argument("--torch_adam", action="store_true",
                        help="pass torch.optim.Adam as the client optimizer instead of the config's Adam")
    args = parser.parse_args()

    deepspeed.init_distributed()
    rank = deepspeed.comm.get_rank()
    seed = 42
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    data_iterator = create_data_iterator(batch_size=4, mask_prob=0.15, rank=rank)
    model = create_model()
    ds_config = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "fp16": {"enabled": args.dtype == "fp16"},
        "bf16": {"enabled": args.dtype == "bf16"},
        "zero_optimization": {"stage": args.zero_stage},
        "steps_per_print": 1000,
    }
    optimizer = None
    if args.torch_adam:
        # The same optimizer arithmetic under both frameworks: DeepSpeed's own CPU Adam kernel
        # rounds differently from torch's, which six Adam steps amplify past fp32's 1e-5.
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        del ds_config["optimizer"]
        ds_config["zero_allow_untested_optimizer"] = True
    model, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), optimizer=optimizer,
                                          config=ds_config)

    exp_dir = f"{args.out}/ckpt"
    start_step = 1
    if args.phase == "resume":
        _, client_state = model.load_checkpoint(load_dir=exp_dir)
        start_step = client_state["checkpoint_step"] + 1
    model.train()
    losses = []
    for step in range(start_step, args.num_iterations + 1):
        batch = next(data_iterator)
        batch = {k: v.to(model.device) for k, v in batch.items()}
        loss = model(**batch).loss
        model.backward(loss)
        model.step()
        losses.append(loss.item())
        if args.phase == "save" and step % args.checkpoint_every == 0:
            model.save_checkpoint(save_dir=exp_dir, client_state={"checkpoint_step": step})
            break
    check_framework(deepspeed)
    record_losses(args.out, args.phase, rank, losses)
    print(f"rank {rank} {args.phase} losses {losses}", flush=True)


if __name__ == "__main__":
    main()
