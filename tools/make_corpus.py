"""Regenerate zeroshard/examples/data/corpus.txt: a small, learnable English-like corpus.

The text is produced from a fixed grammar with a fixed seed, so the shipped file is our own
and reproducible; nothing is downloaded. Run: python tools/make_corpus.py
"""

from __future__ import annotations

import random
from pathlib import Path

SUBJECTS = ["the engineer", "a small model", "the optimizer", "each rank", "the launcher",
            "the data loader", "a careful student", "the old machine", "the cluster",
            "every shard", "the gradient", "a quiet process", "the scheduler", "the team"]
VERBS = ["trains", "gathers", "reduces", "saves", "loads", "splits", "measures", "checks",
         "waits for", "sends", "keeps", "updates", "counts", "writes"]
OBJECTS = ["the weights", "a checkpoint", "the loss", "its partition", "the batch",
           "a long log", "the learning rate", "the buffers", "every parameter", "the memory",
           "a new plan", "the results", "the corpus", "its own notes"]
ADVERBS = ["slowly", "quickly", "at night", "before dawn", "in order", "with care",
           "without a sound", "once more", "every step", "on time"]
CONNECTIVES = ["and then", "but", "so", "while", "because"]


def sentence(rng: random.Random) -> str:
    clause = f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)}"
    if rng.random() < 0.5:
        clause += f" {rng.choice(ADVERBS)}"
    if rng.random() < 0.4:
        clause += f", {rng.choice(CONNECTIVES)} {rng.choice(SUBJECTS)} {rng.choice(VERBS)}"
        clause += f" {rng.choice(OBJECTS)}"
    return clause[0].upper() + clause[1:] + "."


def main() -> None:
    rng = random.Random(1234)
    paragraphs = []
    while sum(len(p) for p in paragraphs) < 400_000:
        paragraphs.append(" ".join(sentence(rng) for _ in range(rng.randint(3, 7))))
    out = Path(__file__).resolve().parents[1] / "zeroshard" / "examples" / "data" / "corpus.txt"
    out.write_text("\n\n".join(paragraphs) + "\n", encoding="utf-8")
    print(f"wrote {out} ({out.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
