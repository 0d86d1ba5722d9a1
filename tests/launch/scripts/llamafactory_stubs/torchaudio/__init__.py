"""Stand-in for `torchaudio`, which LLaMA-Factory 0.9.5 imports at module level (data/mm_plugin.py) for
audio inputs only. PyPI has no torchaudio build for torch 2.13 on CPU (2.11.1 links CUDA torch 2.11), so
tests/launch/test_llamafactory_flows.py puts this directory on the jobs' PYTHONPATH where torchaudio is not
installed. Text-only runs never call it; any use fails, naming this file."""


def __getattr__(name: str) -> object:
    raise ImportError(f"torchaudio.{name}: torchaudio is a stand-in here (tests/launch/scripts/llamafactory_stubs); "
                      "install a torchaudio built for this torch to use audio inputs")
