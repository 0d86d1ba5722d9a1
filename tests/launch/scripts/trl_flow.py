"""TRL's GRPO and DPO trainers, written the way TRL's docs write them, on a tiny Llama built from a
config with a byte-level BPE tokenizer trained here (no download), the DeepSpeed config given as
TrainingArguments' `deepspeed=` (TRL's own zero2/zero3 recipes in dict form). At ZeRO-3, TRL wraps
its reference model with `prepare_deepspeed` (dotted top-level config keys) and GRPO generates
through `unwrap_model_for_generation` (engine.optimizer.parameter_offload's hooks removed and put
back). Writes the logged metrics per step to --results.

    python trl_flow.py --make-model DIR
    torchrun --nproc-per-node 2 trl_flow.py --flow grpo --stage 3 --model DIR --out OUT --results R.json
"""

from __future__ import annotations

import argparse
import json
import os

WORDS = "the a cat dog sat ran on mat fast slow red blue big small yes no".split()


def make_model(path: str) -> None:
    import torch
    from tokenizers import ByteLevelBPETokenizer
    from transformers import GPT2TokenizerFast, LlamaConfig, LlamaForCausalLM

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator([" ".join(WORDS)] * 4, vocab_size=300, min_frequency=1, special_tokens=["<|endoftext|>"])
    os.makedirs(path, exist_ok=True)
    bpe.save_model(path)
    end = "<|endoftext|>"
    tok = GPT2TokenizerFast(os.path.join(path, "vocab.json"), os.path.join(path, "merges.txt"), eos_token=end,
                            bos_token=end, unk_token=end, pad_token=end)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=False, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                      bos_token_id=tok.bos_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)


def ds_config(stage: int) -> dict:
    zero: dict = {"stage": stage}
    if stage == 3:
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    return {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
            "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "zero_optimization": zero,
            "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"}}


def prompts(i: int, n: int) -> str:
    return " ".join(WORDS[(i + j) % 12] for j in range(n))


def grpo(args: argparse.Namespace) -> object:
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    def reward_len(completions: list[str], **_: object) -> list[float]:
        return [-abs(8 - len(c)) / 8.0 for c in completions]

    cfg = GRPOConfig(output_dir=args.out, per_device_train_batch_size=4, num_generations=4, max_completion_length=8,
                     max_steps=3, logging_steps=1, report_to=[], learning_rate=1e-3, seed=7, beta=0.1,
                     save_strategy="no", use_cpu=True, deepspeed=ds_config(args.stage))
    data = Dataset.from_dict({"prompt": [prompts(i, 4) for i in range(16)]})
    return GRPOTrainer(model=args.model, reward_funcs=reward_len, args=cfg, train_dataset=data)


def dpo(args: argparse.Namespace) -> object:
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    rows = {"prompt": [prompts(i, 4) for i in range(16)],
            "chosen": [" " + prompts(3 * i, 3) for i in range(16)],
            "rejected": [" " + prompts(5 * i, 3) for i in range(16)]}
    cfg = DPOConfig(output_dir=args.out, per_device_train_batch_size=2, max_steps=3, logging_steps=1, report_to=[],
                    learning_rate=1e-3, seed=7, save_strategy="no", use_cpu=True, deepspeed=ds_config(args.stage))
    return DPOTrainer(model=args.model, args=cfg, train_dataset=Dataset.from_dict(rows))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--make-model")
    p.add_argument("--flow", choices=["grpo", "dpo"])
    p.add_argument("--stage", type=int, default=3)
    p.add_argument("--model")
    p.add_argument("--out")
    p.add_argument("--results")
    p.add_argument("--local_rank", type=int, default=-1)
    args = p.parse_args()
    if args.make_model:
        make_model(args.make_model)
        return
    trainer = {"grpo": grpo, "dpo": dpo}[args.flow](args)
    trainer.train()  # type: ignore[attr-defined]
    if trainer.accelerator.is_main_process:  # type: ignore[attr-defined]
        log = [h for h in trainer.state.log_history if "loss" in h]  # type: ignore[attr-defined]
        with open(args.results, "w") as f:
            json.dump(log, f)


if __name__ == "__main__":
    main()
