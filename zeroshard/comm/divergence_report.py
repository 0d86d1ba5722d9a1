"""The divergence report's text: each rank's published state as one line, and the verdict.

Works on the states ranks publish (``CollectiveTracker.snapshot``: plain dicts, as read back from
the c10d store), so the text is the same on every rank and testable without a process group
(Note: [divergence diagnostics] in divergence.py). Imports nothing of ours.
"""

from __future__ import annotations

from typing import Any


def format_call(call: dict[str, Any]) -> str:
    """``seq 12 all_reduce(numel=1024, float32) at engine.py:88`` from a published record."""
    return f"seq {call['seq']} {_call_text(call)}"


def _call_text(call: dict[str, Any]) -> str:
    args = "" if call["dtype"] is None else f"(numel={call['numel']}, {call['dtype']})"
    return f"{call['op']}{args} at {call['where']}"


def mismatch_text(seq: int) -> str:
    """The cause line of a signature mismatch (Note: [collective signature check] in checked.py)."""
    return (f"collective mismatch: the ranks' collective seq {seq} differ in operation, size or "
            "dtype (found before any data moved)")


def first_line(error: BaseException) -> str:
    """The first line of ``error``'s message, without gloo's source-file prefix."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    if text.startswith("[") and "] " in text:  # gloo prefixes its source file: drop it
        text = text.split("] ", 1)[1]
    return text


def _describe_rank(r: int, state: dict[str, Any] | None, top: int) -> str:
    if state is None:
        return (f"rank {r}: never published a state (it has not reached init_distributed, "
                "or died before it)")
    last = state["last"]
    last_text = "no collective yet" if last is None else format_call(last)
    if state["state"] != "running":
        why = f" ({state['reason']})" if state["reason"] else ""
        return f"rank {r}: {state['state']}{why} after {last_text}"
    if state["waiting"] is not None:
        line = f"rank {r}: {format_call(state['waiting'])} — waiting {state['wait_s']:.1f} s"
    elif last is not None and state["done"] < last["seq"]:
        line = f"rank {r}: {last_text} — issued (async), not yet waited"
    else:
        line = f"rank {r}: {last_text} — not in a collective"
    if state["seq"] < top:
        line += f" (never reached seq {top})"
    if state.get("stale"):
        line += " [no answer: last published state; rank busy without the GIL?]"
    return line


def call_at(state: dict[str, Any], seq: int) -> dict[str, Any] | None:
    """The published record of collective ``seq`` of one rank, if its state still holds it."""
    for call in (state.get("mismatch"), state["waiting"], state["last"], *state.get("pending", ())):
        if call is not None and call["seq"] == seq:
            return call
    return None


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def disagreement(states: dict[int, dict[str, Any]], seq: int) -> str | None:
    """What each rank issued as its collective ``seq``, in one sentence, when they differ (None
    when they agree or too few ranks answered): the script's own collectives first (Note:
    [script collectives] in user_collectives.py), with their call sites, then zeroshard's.

    ``rank 0 issued torch.distributed.all_reduce(numel=1, float32) at train.py:40; rank 1 issued
    zeroshard's reduce_scatter(numel=192, float32) at reduce.py:274 via train.py:35``
    """
    by_call: dict[str, list[int]] = {}
    script: set[str] = set()
    for r, state in sorted(states.items()):
        call = call_at(state, seq)
        if call is None:
            continue
        text = _call_text(call)
        if call.get("api"):
            script.add(text)
        by_call.setdefault(text, []).append(r)
    if len(by_call) < 2:
        return None
    order = sorted(by_call, key=lambda text: (text not in script, by_call[text]))
    parts = []
    for text in order:
        owner = "zeroshard's " if script and text not in script else ""
        parts.append(f"{_ranks(by_call[text])} issued {owner}{text}")
    return "; ".join(parts)


def focus_seq(states: dict[int, dict[str, Any]]) -> int:
    """The collective the verdict is about: the first one a signature check found to differ
    (later ones may have been issued asynchronously since), else the newest any rank issued."""
    found = [s["mismatch"]["seq"] for s in states.values() if s.get("mismatch")]
    return min(found) if found else max((s["seq"] for s in states.values()), default=0)


def describe_states(states: dict[int, dict[str, Any]], world_size: int) -> list[str]:
    """One line per rank plus a verdict naming the ranks that fell behind or disagree."""
    top = max((s["seq"] for s in states.values()), default=0)
    lines = [f"Last collective of each rank (group of {world_size}):"]
    lines += ["  " + _describe_rank(r, states.get(r), top) for r in range(world_size)]
    behind = [r for r in range(world_size) if r in states and states[r]["seq"] < top]
    focus = focus_seq(states)
    at_focus: dict[str, list[int]] = {}
    for r, s in sorted(states.items()):
        call = call_at(s, focus)
        if call is not None:
            key = f"{call['op']}(numel={call['numel']}, {call['dtype']})"
            at_focus.setdefault(key, []).append(r)
    if len(at_focus) > 1:
        what = "; ".join(f"ranks {v} {k}" for k, v in at_focus.items())
        lines.append(f"Ranks disagree on seq {focus}: {what}.")
    if behind:
        lines.append(f"Ranks {behind} never reached seq {top}.")
    if behind or len(at_focus) > 1:
        lines.append("Every rank must issue the same collectives in the same order; a save, an "
                     "eval or an extra batch on some ranks only leaves the others waiting.")
    return lines
