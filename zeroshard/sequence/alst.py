"""Arctic Long Sequence Training (ALST) for Hugging Face models: DeepSpeed 0.19's
`deepspeed.runtime.sequence_parallel.ulysses_sp` API, built on zeroshard's Ulysses exchange.

- `UlyssesSPAttentionHF.register_with_transformers(...)` creates the sequence-parallel groups
  (sequence/parallel_state.py), and replaces Transformers' attention function of the chosen
  implementation (``"sdpa"``, flash, flex; not ``"eager"``) by a wrapper that all-to-alls the
  sequence-sharded q/k/v into head-sharded full sequences, runs the original function, and
  all-to-alls back. It returns the mpu to give ``initialize(mpu=...)``.
- `UlyssesSPDataLoaderAdapter` turns each sequence-parallel rank's batches into micro-batches that
  all ranks of the group share: it gathers the group's batches, and yields them one after the other,
  each cut along the sequence, with the labels pre-shifted as ``shift_labels`` (a rank's slice no
  longer holds the next token of its last position).
- Tiled MLP and logits-loss are in sequence/tiled.py.

Causality comes from the gathered sequence (the wrapper drops Transformers' local attention mask and
the attention runs causal over the whole sample: sdpa and flash are causal without a mask, flex gets a
causal BlockMask of the whole length), so samples are not packed; ``position_ids`` are
required (rotary positions of each slice, gathered for the attention function). Imports torch,
comm and the sequence package; Transformers only inside `register_with_transformers`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

from zeroshard.comm import all_gather, all_gather_object, get_rank, get_world_size
from zeroshard.sequence import parallel_state
from zeroshard.sequence.ulysses import seq_all_to_all

_ORIGINAL: dict[str, Callable[..., Any]] = {}
"""Transformers' attention functions this process replaced: implementation -> the original."""


class UlyssesSPAttentionHF(nn.Module):
    """Ulysses sequence parallelism around a Transformers attention function.

    Args (DeepSpeed 0.19.8's):
        attn: the attention function (``transformers.modeling_utils.ALL_ATTENTION_FUNCTIONS[...]``).
        batch_size: micro-batch size (checked against q's batch when the length is fixed).
        attn_head_count, attn_head_size, kv_head_count: the model's heads; the group size must
            divide the query heads, and divide or be a multiple of the KV heads (fewer KV heads than
            ranks are replicated, as DeepSpeed does).
        num_hidden_layers: accepted for DeepSpeed's signature (its debug mode counts layers).
        process_group: the sequence-parallel group.
        seq_length_is_variable: True: every batch may have another length.
        local_seq_length, global_seq_length: the fixed lengths otherwise.
        disable_in_eval: in eval mode call the attention unchanged (each rank attends its own input).

    Raises:
        ValueError: head counts the group cannot split (DeepSpeed's messages).
    """

    def __init__(self, attn: Callable[..., Any], batch_size: int, attn_head_count: int, attn_head_size: int,
                 kv_head_count: int, num_hidden_layers: int, process_group: Any, seq_length_is_variable: bool = False,
                 local_seq_length: int | None = None, global_seq_length: int | None = None,
                 disable_in_eval: bool = False) -> None:
        super().__init__()
        self.attn = attn
        self.process_group = process_group
        self.world_size = get_world_size(process_group)
        self.sp_rank = get_rank(process_group)
        self.batch_size = batch_size
        self.seq_length_is_variable = seq_length_is_variable
        self.local_seq_length, self.global_seq_length = local_seq_length, global_seq_length
        self.disable_in_eval = disable_in_eval
        self.attn_head_size, self.attn_head_count = attn_head_size, attn_head_count
        self.global_kv_head_count = kv_head_count
        self.num_hidden_layers = num_hidden_layers
        self.core_attn_implementation: str | None = None
        self._flex_mask: tuple[tuple[Any, ...], Any] | None = None  # ((batch, length, device), its BlockMask)
        if attn_head_count % self.world_size:
            raise ValueError(f"Attention head count {attn_head_count} is not divisible by SP size {self.world_size}")
        if kv_head_count % self.world_size and self.world_size % kv_head_count:
            raise ValueError(f"KV attention head count {kv_head_count} is not divisible by SP size {self.world_size} "
                             "or vice versa")
        self.kv_replication_factor = max(1, self.world_size // kv_head_count)
        self.local_q_head_count = attn_head_count // self.world_size
        self.local_kv_head_count = max(1, kv_head_count // self.world_size)

    def _check_shapes(self, query: Tensor, key: Tensor) -> None:
        """[b, h, s, d] with the model's heads; the fixed length when the length is not variable."""
        want_q = (self.attn_head_count, self.attn_head_size)
        want_kv = (self.global_kv_head_count, self.attn_head_size)
        if (query.shape[1], query.shape[3]) != want_q or (key.shape[1], key.shape[3]) != want_kv:
            raise ValueError(f"UlyssesSPAttentionHF: q {tuple(query.shape)} / k {tuple(key.shape)} do not have "
                             f"{self.attn_head_count} / {self.global_kv_head_count} heads of {self.attn_head_size} "
                             "([batch, heads, seq, head_dim])")
        if not self.seq_length_is_variable and (query.shape[2] != self.local_seq_length
                                                or query.shape[0] != self.batch_size):
            raise ValueError(f"UlyssesSPAttentionHF: q has batch {query.shape[0]} and local length {query.shape[2]}, "
                             f"expected {self.batch_size} and {self.local_seq_length} (seq_length_is_variable=False)")

    def forward(self, module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Any,
                *args: Any, **kwargs: Any) -> tuple[Tensor, Any]:
        """Transformers' attention-function call on this rank's slice ([b, h, s_local, d]); returns
        (context [b, s_local, h * d], the attention function's weights)."""
        if self.disable_in_eval and not module.training:
            return self.attn(module, query, key, value, attention_mask, *args, **kwargs)
        if "position_ids" not in kwargs or kwargs["position_ids"] is None:
            raise ValueError("Ulysses SP needs position_ids in every forward() (each slice's global positions, e.g. "
                             "torch.arange(seq_len) per sample, cut as the input is); UlyssesSPDataLoaderAdapter "
                             "passes them on when the data loader's batches have them.")
        self._check_shapes(query, key)
        pieces = [torch.empty_like(kwargs["position_ids"]) for _ in range(self.world_size)]
        all_gather(pieces, kwargs["position_ids"].contiguous(), group=self.process_group)
        kwargs["position_ids"] = torch.cat(pieces, dim=1)
        if self.kv_replication_factor > 1:  # fewer KV heads than ranks: each rank gets one (copied) KV head
            key, value = (t.repeat_interleave(self.kv_replication_factor, dim=1) for t in (key, value))
        # [b, h, s_local, d] -> [b, h / P, s, d]: scatter the heads, gather the sequence
        q, k, v = (seq_all_to_all(t, self.process_group, 1, 2) for t in (query, key, value))
        if hasattr(module, "num_key_value_groups"):
            module.num_key_value_groups = q.shape[1] // k.shape[1]
        mask = self._flex_causal_mask(q) if "flex" in (self.core_attn_implementation or "") else None
        context, weights = self.attn(module, q, k, v, mask, *args, **kwargs)  # [b, s, h / P, d]
        context = seq_all_to_all(context, self.process_group, 1, 2)  # -> [b, s_local, h, d]
        return context.reshape(*context.shape[:2], -1), weights

    def _flex_causal_mask(self, q: Tensor) -> Any:
        """flex attention's causal BlockMask over the gathered sequence of `q` ([b, h, s, d]). The
        sdpa and flash functions run causal when given no mask; Transformers' flex function then runs
        non-causal, and the BlockMask Transformers built is for the local slice's length. Built once per
        (batch, length, device) and shared by the layers."""
        key = (q.shape[0], q.shape[2], q.device)
        if self._flex_mask is None or self._flex_mask[0] != key:
            from torch.nn.attention.flex_attention import create_block_mask

            def causal(batch: Tensor, head: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
                return q_idx >= kv_idx

            self._flex_mask = (key, create_block_mask(causal, B=q.shape[0], H=None, Q_LEN=q.shape[2],
                                                      KV_LEN=q.shape[2], device=q.device))
        return self._flex_mask[1]

    @classmethod
    def register_with_transformers(cls, model_name_or_path: Any, core_attn_implementation: str,
                                   sequence_parallel_size: int, micro_batch_size: int, seq_length: int | None = None,
                                   seq_length_is_variable: bool = True, disable_in_eval: bool = False,
                                   max_length: int | None = None) -> Any:
        """Create the sequence-parallel groups and route Transformers' `core_attn_implementation`
        through Ulysses; returns the mpu for ``initialize(mpu=...)`` (None when the size is 1).

        Args:
            model_name_or_path: the model (or its config holder), or a local path to its config
                (nothing is downloaded).
            core_attn_implementation: the model's attention implementation ("sdpa", a flash or flex
                variant); "eager" is refused (it needs the whole [s, s] mask).
            sequence_parallel_size: ranks per group.
            micro_batch_size: the micro-batch size.
            seq_length: the fixed sequence length, when `seq_length_is_variable` is False.
            seq_length_is_variable: whether batches may differ in length.
            disable_in_eval: attention unchanged in eval mode.
            max_length: DeepSpeed's deprecated spelling of `seq_length`.

        Raises:
            ValueError: eager attention, an implementation Transformers does not have, a model whose
                attention implementation is another one, or no length for a fixed-length run.
        """
        if sequence_parallel_size == 1:
            return None
        seq_length = seq_length if seq_length is not None else max_length
        if not seq_length_is_variable and seq_length is None:
            raise ValueError("Either `seq_length_is_variable` needs to be `True` or `seq_length` needs to be set "
                             "to the fixed sequence length.")
        from transformers import AutoConfig
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        parallel_state.initialize_sequence_parallel(sequence_parallel_size)
        loaded = hasattr(model_name_or_path, "config")
        config = model_name_or_path.config if loaded else AutoConfig.from_pretrained(model_name_or_path)
        if loaded:
            active = getattr(config, "_attn_implementation", None)
            if active is not None and active != core_attn_implementation:
                raise ValueError(f"core_attn_implementation='{core_attn_implementation}' does not match model config "
                                 f"attn_implementation='{active}'. Set both to the same value.")
        if core_attn_implementation in ("eager", "paged|eager"):
            raise ValueError(f"{core_attn_implementation} attn_implementation isn't supported by Ulysses sequence "
                             "parallelism: it needs the whole 4D attention_mask. Use 'sdpa', a flash attention variant "
                             "or 'flex_attention'.")
        if core_attn_implementation not in ALL_ATTENTION_FUNCTIONS:
            raise ValueError(f"{core_attn_implementation} is not a valid attn_implementation. The choices are "
                             f"{ALL_ATTENTION_FUNCTIONS.valid_keys()}")
        original = _ORIGINAL.setdefault(core_attn_implementation, ALL_ATTENTION_FUNCTIONS[core_attn_implementation])
        text = config.get_text_config()
        size = parallel_state.get_sequence_parallel_world_size()
        uattn = cls(attn=original, batch_size=micro_batch_size, attn_head_count=text.num_attention_heads,
                    attn_head_size=getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads,
                    kv_head_count=getattr(text, "num_key_value_heads", None) or text.num_attention_heads,
                    num_hidden_layers=text.num_hidden_layers,
                    process_group=parallel_state.get_sequence_parallel_group(),
                    seq_length_is_variable=seq_length_is_variable,
                    local_seq_length=None if seq_length_is_variable else seq_length // size,
                    global_seq_length=None if seq_length_is_variable else seq_length, disable_in_eval=disable_in_eval)
        uattn.core_attn_implementation = core_attn_implementation

        def ulysses_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Any,
                              *args: Any, **kwargs: Any) -> tuple[Tensor, Any]:
            return uattn(module, query, key, value, attention_mask, *args, **kwargs)

        ALL_ATTENTION_FUNCTIONS[core_attn_implementation] = ulysses_attention
        return parallel_state


def restore_transformers_attention() -> None:
    """Put back every Transformers attention function `register_with_transformers` replaced in this
    process (zeroshard's addition: a script or test that trains with and without SP in one process)."""
    if not _ORIGINAL:
        return
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    for name, fn in _ORIGINAL.items():
        ALL_ATTENTION_FUNCTIONS[name] = fn
    _ORIGINAL.clear()


class UlyssesSPDataLoaderAdapter:
    """Sequence-parallel micro-batches from any data loader (DeepSpeed 0.19.8's adapter).

    Every rank of a sequence-parallel group reads its own batches; each batch the wrapped loader
    yields on any rank becomes one micro-batch on every rank of the group, in rank order, cut along
    the sequence (dim 1) to this rank's slice. So the group consumes ``sp`` batches per ``sp``
    micro-steps, as ``sp`` data-parallel ranks would in one. Batches are dicts with ``input_ids``,
    ``position_ids`` and ``labels`` (``[batch, seq]``; other tensors are cut too, non-tensors copied);
    ``labels`` become ``shift_labels`` (each position's next token, -100 at the end), shifted before
    the cut. Every rank's sequence length must divide by ``sp`` (lengths may differ between ranks).

    Raises:
        ValueError: a batch without ``position_ids``, tensors of other lengths than ``input_ids``,
            or a length ``sp`` does not divide.
    """

    def __init__(self, dl: Any, sp_rank: int, sp_group: Any, sp_world_size: int, device: Any) -> None:
        self.dl, self.sp_rank, self.sp_group, self.sp_world_size, self.device = (dl, sp_rank, sp_group,
                                                                                 sp_world_size, device)
        self.iter: Iterator[Any] = iter(dl)
        self.micro_batches: deque[dict[str, Any]] = deque()

    def __len__(self) -> int:
        return len(self.dl) * self.sp_world_size

    def __iter__(self) -> UlyssesSPDataLoaderAdapter:
        return self

    def __next__(self) -> dict[str, Any]:
        if not self.micro_batches:
            self.refill()
        return self.micro_batches.popleft()

    def refill(self) -> None:
        """Gather one batch from every rank of the group and queue their slices."""
        try:
            batch = next(self.iter)
        except StopIteration:
            self.iter = iter(self.dl)  # the next pass is a new epoch; this one ends here
            raise
        if "position_ids" not in batch:
            raise ValueError("Ulysses SP requires `position_ids` in every data loader batch (each token's position "
                             "in its sample, e.g. torch.arange(seq_len)), so that the slices keep their global "
                             "positions; add them in the collator.")
        length = batch["input_ids"].shape[1]
        lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(self.sp_world_size)]
        all_gather(lengths, torch.tensor([length], dtype=torch.int64), group=self.sp_group)
        gathered: list[dict[str, Any]] = [{} for _ in range(self.sp_world_size)]
        for key, value in batch.items():
            if torch.is_tensor(value):
                if value.shape[1] != length:
                    raise ValueError(f"{key}'s shape {tuple(value.shape)} must match input_ids's shape "
                                     f"{tuple(batch['input_ids'].shape)}")
                value = value.contiguous()
                parts = [torch.empty((value.shape[0], int(n.item()), *value.shape[2:]), dtype=value.dtype)
                         for n in lengths]
                all_gather(parts, value, group=self.sp_group)
            else:
                parts = [None] * self.sp_world_size
                all_gather_object(parts, value, group=self.sp_group)
            for i, part in enumerate(parts):
                gathered[i][key] = part
        for sample in gathered:
            self.micro_batches.append(self._slice(sample))

    def _slice(self, sample: dict[str, Any]) -> dict[str, Any]:
        length = sample["input_ids"].shape[1]
        if length % self.sp_world_size:
            raise ValueError(f"batch's seqlen={length} isn't divisible by sp-size={self.sp_world_size}")
        chunk = length // self.sp_world_size
        labels = sample.pop("labels")
        sample["shift_labels"] = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:].contiguous()
        cut = slice(chunk * self.sp_rank, chunk * (self.sp_rank + 1))
        return {k: v[:, cut].to(self.device) if torch.is_tensor(v) else v for k, v in sample.items()}
