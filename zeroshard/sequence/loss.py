"""The loss of a sample split over a sequence-parallel group, for scripts that compute their own.

Each rank sees a slice of the sequence, so its mean loss covers its own tokens only, and slices
may hold different numbers of counted tokens (labels masked with -100: prompts, padding). The
sample's loss is the token-weighted mean over the group. `token_weighted_loss` returns that mean
as its value (the same on every rank of the group, for logging) and this rank's share of it as its
gradient, which is what the engine expects (Note: [sequence-parallel gradients] in sp_setup.py).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from zeroshard.comm import all_reduce
from zeroshard.sequence.sp_groups import current_sequence_groups

IGNORE_INDEX = -100
"""The label torch's cross-entropy (and Hugging Face) leaves out of the mean."""


def token_weighted_loss(loss: Tensor, valid_tokens: Tensor | int, group: Any = None) -> Tensor:
    """The sequence-parallel group's token-weighted mean loss, backpropagating this rank's share.

    Args:
        loss: this rank's mean loss over its `valid_tokens` counted tokens (any value when there are
            none: a slice of only masked tokens contributes nothing, not its NaN).
        valid_tokens: how many tokens `loss` averages, e.g. ``(shift_labels != -100).sum()``.
        group: the sequence-parallel group; default the current one (zeroshard/sequence/sp_groups.py).

    Returns:
        A scalar whose value is sum(loss_r * n_r) / sum(n_r) over the group's ranks r and whose
        gradient is that of loss * n / sum(n_r): the shares add up to the sample's loss.
    """
    if group is None:
        seq = current_sequence_groups()
        if seq is None:
            raise RuntimeError("token_weighted_loss: no sequence-parallel group exists yet; set "
                               "sequence_parallel_size in the config (and call initialize first) or pass group=.")
        group = seq.sp.dp_group
    count = torch.as_tensor(valid_tokens, device=loss.device).float()
    local_sum = torch.where(count > 0, loss.float(), torch.zeros((), device=loss.device)) * count
    totals = torch.stack((local_sum.detach(), count))
    if group is not None:  # None: a group of one rank
        all_reduce(totals, group=group)
    return (local_sum + (totals[0] - local_sum.detach())) / totals[1].clamp(min=1.0)
