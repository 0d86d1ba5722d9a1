"""deepspeed.runtime.sequence_parallel.ulysses_sp -> zeroshard.sequence.alst (ALST for Hugging Face
models) and zeroshard.sequence.tiled (tiled MLP and logits-loss)."""

from zeroshard.compat._names import reexport as _reexport

_TARGETS = {
    "UlyssesSPAttentionHF": "zeroshard.sequence.alst:UlyssesSPAttentionHF",
    "UlyssesSPDataLoaderAdapter": "zeroshard.sequence.alst:UlyssesSPDataLoaderAdapter",
    "TiledMLP": "zeroshard.sequence.tiled:TiledMLP",
    "TiledFusedLogitsLoss": "zeroshard.sequence.tiled:TiledFusedLogitsLoss",
    "SequenceTiledCompute": "zeroshard.sequence.tiled:SequenceTiledCompute",
    "sequence_tiled_compute": "zeroshard.sequence.tiled:sequence_tiled_compute",
}
__getattr__, __dir__ = _reexport(__name__, _TARGETS)
