"""Which mpu is ALST's sequence-parallel one (sequence/sp_setup.py), and the sizes asked more than once:
pure functions, no process group."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from zeroshard.errors import ConfigError, NotSupportedError
from zeroshard.sequence import parallel_state
from zeroshard.sequence.sp_setup import check_megatron_sequence_mpu, is_sequence_mpu, mesh_shape, sequence_size


class AnswersEverything:
    """An mpu stub that answers every query with 1 (as some tests' mocks do): a Megatron mpu, not ALST's."""

    def __getattr__(self, name: str):
        return lambda: 1


def test_only_an_mpu_without_data_parallel_queries_is_alsts() -> None:
    assert is_sequence_mpu(parallel_state)
    assert not is_sequence_mpu(AnswersEverything())
    assert not is_sequence_mpu(None)
    megatron = SimpleNamespace(initialize_sequence_parallel=None, get_data_parallel_world_size=lambda: 2,
                               get_sequence_parallel_world_size=lambda: 2)
    assert not is_sequence_mpu(megatron)
    with pytest.raises(NotSupportedError, match="sequence-parallel size of 2 \\(Megatron-DeepSpeed's Ulysses\\)"):
        check_megatron_sequence_mpu(megatron)
    check_megatron_sequence_mpu(AnswersEverything())  # size 1: nothing to refuse


def test_sizes_asked_more_than_once_must_agree() -> None:
    alst = SimpleNamespace(initialize_sequence_parallel=None, get_sequence_parallel_world_size=lambda: 2)
    assert sequence_size(1, None) == 1 and sequence_size(4, None) == 4
    assert sequence_size(1, alst) == 2 and sequence_size(2, alst, (3, 2)) == 2
    with pytest.raises(ConfigError, match="sequence_parallel_size in the config = 4, the mpu's sequence-parallel "
                                          "group = 2"):
        sequence_size(4, alst)
    with pytest.raises(ConfigError, match="expected \\(data_parallel_size, sequence_parallel_size\\)"):
        mesh_shape((2, 0))
    assert mesh_shape([3, 2]) == (3, 2)
