"""What `zeroshard launch` says when a job ends: the preemption summary (from the ranks' notes,
runtime/preemption.py), the restart summary (the attempts torchrun made, counted from its
``--log_dir``), and the last good checkpoint under ``checkpoint.auto_resume_dir`` (read from a
ds_config JSON file named in the script's arguments). Imports nothing of ours but `zeroshard.errors`.
"""

from __future__ import annotations

import json
from pathlib import Path

from zeroshard.errors import PREEMPTED_EXIT_CODE

__all__ = ["attempt_starts", "last_checkpoint", "membership_restart", "preempted_attempts", "preemption_summary",
           "read_notes", "restart_summary", "resume_dir_of"]


def preemption_summary(notes: list[dict[str, object]]) -> str:
    """One paragraph from the preempted ranks' notes (runtime/preemption.py writes them): the
    emergency checkpoint and its slowest rank's seconds, or the ranks that exited without one."""
    signals = sorted({str(n.get("signal")) for n in notes})
    failed = sorted(int(str(n["rank"])) for n in notes if not n.get("checkpoint"))
    saved = [n for n in notes if n.get("checkpoint")]
    head = f"zeroshard launch: preempted ({', '.join(signals)}); "
    if failed:
        return (head + f"rank(s) {', '.join(map(str, failed))} exited without an emergency checkpoint (see their "
                "log lines); `latest` names the last complete checkpoint, which a restart resumes from. "
                f"Exit status {PREEMPTED_EXIT_CODE}: restart the job.")
    where = sorted({str(n["checkpoint"]) for n in saved})
    save_s = max(float(str(n["save_s"])) for n in saved)
    since_s = max(float(str(n["since_signal_s"])) for n in saved)
    return (head + f"emergency checkpoint {', '.join(where)} after step {saved[0]['step']}, saved in {save_s:.2f} s "
            f"({since_s:.2f} s after the signal, grace {float(str(saved[0]['grace_s'])):g} s; notes from "
            f"{len(saved)} rank(s)). Exit status {PREEMPTED_EXIT_CODE}: restart the job to resume (with "
            "checkpoint.auto_resume_dir it resumes by itself).")


def restart_summary(code: int, restarts: int | None, max_restarts: int, *,
                    preempted: dict[int, str] | None = None, resume_dir: str | None = None,
                    checkpoint: str | None = None, stopped_by: str | None = None,
                    membership: str | None = None) -> str:
    """One paragraph on how the job ended: the restarts torchrun made (``restarts``, None when no
    attempt started), what ended each attempt (``preempted`` maps an attempt to its preemption's
    details; the others failed, as torchrun's error report says), and the exit status ``code``.
    When the job failed with no restart left, it says that restarts are exhausted, or that
    ``stopped_by`` (a signal the launcher passed on) stopped it, and names ``checkpoint`` (the
    last complete one under ``resume_dir``), or says why it cannot. ``membership``
    (`membership_restart`) is said after the first sentence.

    Example::

        >>> restart_summary(0, 1, 2)
        'zeroshard launch: 1 restart (--max_restarts 2): attempt 0 failed, attempt 1 finished. Exit status 0.'
    """
    preempted = preempted or {}
    if restarts is None:
        return (f"zeroshard launch: no attempt started (the rendezvous did not complete; see torchrun's lines "
                f"above). Exit status {code}.")

    def ended(k: int) -> str:
        if k in preempted:
            return f"attempt {k} was preempted (exit {PREEMPTED_EXIT_CODE}{preempted[k]})"
        return f"attempt {k} {'finished' if k == restarts and code == 0 else 'failed'}"

    head = (f"zeroshard launch: {restarts} restart{'' if restarts == 1 else 's'} (--max_restarts {max_restarts}): "
            + ", ".join(ended(k) for k in range(restarts + 1)) + f". Exit status {code}")
    if membership:
        head += f" ({membership})"
    if code == 0:
        return head + "."
    if stopped_by is not None:
        head += f": the launcher received {stopped_by} and stopped the job (not a failure to restart)."
    elif restarts >= max_restarts:
        head += (": restarts exhausted" + (" (--max_restarts 0: a failed worker ends the job)" if max_restarts == 0
                                          else "") + "; torchrun's error report above names the failed ranks.")
    else:
        head += (f" with {max_restarts - restarts} restart(s) left: the agent stopped for another reason (a signal, "
                 "a rendezvous timeout, or another node's agent ended the job; see torchrun's lines above).")
    if checkpoint is not None:
        return head + (f" The last complete checkpoint is {checkpoint} (`latest` in checkpoint.auto_resume_dir); "
                       "a new launch with the same config resumes from it.")
    if resume_dir is not None:
        return head + (f" checkpoint.auto_resume_dir {resume_dir} holds no checkpoint (no `latest`): "
                       "a new launch starts fresh.")
    return head + (" The launcher does not know the checkpoint directory: it reads checkpoint.auto_resume_dir only "
                   "from a --deepspeed_config / --zeroshard_config JSON file in the script's arguments.")


_CONFIG_FLAGS = ("--deepspeed_config", "--deepspeed-config", "--zeroshard_config", "--zeroshard-config", "--deepspeed")


def resume_dir_of(script_args: list[str]) -> str | None:
    """``checkpoint.auto_resume_dir`` of the ds_config JSON file named in the script's arguments
    (``--deepspeed_config F``, ``--zeroshard_config=F``, HF's ``--deepspeed F.json``), or None."""
    for i, arg in enumerate(script_args):
        flag, eq, value = arg.partition("=")
        if flag not in _CONFIG_FLAGS:
            continue
        if not eq:
            value = script_args[i + 1] if i + 1 < len(script_args) else ""
        if not value.endswith(".json") and flag == "--deepspeed":
            continue  # zeroshard.arguments' --deepspeed is a plain switch
        try:
            cfg = json.loads(Path(value).read_text())
        except (OSError, ValueError):
            continue  # the script reports its own config errors
        section = cfg.get("checkpoint") if isinstance(cfg, dict) else None
        found = section.get("auto_resume_dir") if isinstance(section, dict) else None
        if isinstance(found, str) and found:
            return found
    return None


def last_checkpoint(resume_dir: str | None) -> str | None:
    """The checkpoint ``latest`` names under ``resume_dir`` (written after a save completes), or None."""
    if resume_dir is None:
        return None
    try:
        tag = (Path(resume_dir) / "latest").read_text().strip()
    except OSError:
        return None
    return str(Path(resume_dir) / tag) if tag and (Path(resume_dir) / tag).is_dir() else None


def read_notes(notes_dir: Path) -> list[tuple[float, dict[str, object]]]:
    """The preempted ranks' notes, each with the time it was written."""
    notes = []
    for path in sorted(notes_dir.glob("rank*.json")):
        try:
            notes.append((path.stat().st_mtime, json.loads(path.read_text())))
        except (OSError, ValueError):
            continue  # a note cut short: the others (and the exit status) still tell
    return notes


def attempt_starts(log_dir: Path) -> dict[int, float]:
    """When each attempt began: torchrun makes ``<log_dir>/<run>/attempt_<k>`` (k = its restart count)
    just before it starts that attempt's workers."""
    starts = {}
    for path in log_dir.glob("*/attempt_*"):
        try:
            starts[int(path.name.removeprefix("attempt_"))] = path.stat().st_mtime
        except (ValueError, OSError):
            continue
    return starts


def membership_restart(notes: list[tuple[float, dict[str, object]]], starts: dict[int, float]) -> str | None:
    """What stopped the workers in a membership change, from the notes written before the current
    attempts began: when a node joins (or one leaves and the rest re-form), torchrun stops the workers
    with SIGTERM and starts the group again without counting a restart, and it recreates the attempt
    directories, so those notes predate every attempt. None when there were none.

    Example::

        >>> membership_restart([(5.0, {"signal": "SIGTERM", "checkpoint": "c/global_step5", "step": 5})], {0: 9.0})
        'a membership change (a node joined or left) restarted the workers, not counted as a restart: on SIGTERM, \
emergency checkpoint c/global_step5 after step 5'
    """
    if not starts:
        return None
    before = [note for written, note in notes if written < min(starts.values())]
    if not before:
        return None
    note = before[-1]
    where = (f"emergency checkpoint {note['checkpoint']} after step {note['step']}" if note.get("checkpoint")
             else "no emergency checkpoint")
    return (f"a membership change (a node joined or left) restarted the workers, not counted as a restart: "
            f"on {note.get('signal')}, {where}")


def preempted_attempts(notes: list[tuple[float, dict[str, object]]], starts: dict[int, float]) -> dict[int, str]:
    """Attempt -> `` on SIGTERM, emergency checkpoint <dir> after step <n>`` for the attempts whose
    ranks left preemption notes (a note belongs to the last attempt that began before it was written).
    A rank that torchrun stops with SIGTERM because another rank failed may leave one too."""
    found: dict[int, str] = {}
    for written, note in notes:
        began = [k for k, t in starts.items() if t <= written]
        if began:
            where = (f"emergency checkpoint {note['checkpoint']} after step {note['step']}"
                     if note.get("checkpoint") else "no emergency checkpoint")
            found.setdefault(max(began), f" on {note.get('signal')}, {where}")
    return found
