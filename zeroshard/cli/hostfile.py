"""Hostfiles and device filters for `zeroshard launch`: which hosts run, and on which slots.

Pure functions of strings and paths; imports nothing of ours but `zeroshard.errors` (no torch).

A hostfile lists one host per line in DeepSpeed's (and OpenMPI's) format::

    # comments start with '#'
    worker-0 slots=4
    worker-1 slots=4    # trailing comments are fine

A *slot* is one process; on GPU hosts slot ``i`` is device ``i``. ``--include`` / ``--exclude``
take DeepSpeed's filter syntax, ``NAME[:SLOT[,SLOT...]][@NAME[:SLOT[,SLOT...]]...]``:
``worker-0@worker-1:0,2`` is all of worker-0 plus slots 0 and 2 of worker-1.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from zeroshard.errors import LaunchError

__all__ = [
    "HostSlots",
    "parse_hostfile",
    "parse_hostfile_text",
    "parse_filter",
    "select_hosts",
]

HostSlots = dict[str, list[int]]
"""Host name -> the slot (device) indices that run on it, in hostfile order."""

_HOSTFILE_FIX = "each line must read 'HOSTNAME slots=N' with N >= 1, e.g. 'worker-0 slots=8'"
_HOSTNAME = re.compile(r"^[A-Za-z0-9_.\-\[\]:%@]+$")


def parse_hostfile(path: str | os.PathLike[str]) -> dict[str, int]:
    """Read a hostfile into ``{host: slots}``, keeping the file's order.

    Args:
        path: the hostfile (``HOSTNAME slots=N`` lines, ``#`` comments, blank lines).

    Returns:
        An insertion-ordered dict; the first host is node 0 (and the default master address).

    Raises:
        LaunchError: the file is missing or empty, or a line is malformed, repeats a host or
            gives ``slots`` < 1; the message names the file, the line number and the fix.

    Example::

        >>> parse_hostfile("hostfile")  # doctest: +SKIP
        {'worker-0': 4, 'worker-1': 4}
    """
    p = Path(path)
    try:
        text = p.read_text()
    except FileNotFoundError:
        raise LaunchError(f"{p}: no such hostfile. Pass an existing file to --hostfile.") from None
    except OSError as e:
        raise LaunchError(f"{p}: cannot read hostfile: {e.strerror}") from None
    return parse_hostfile_text(text, source=str(p))


def parse_hostfile_text(text: str, source: str = "<hostfile>") -> dict[str, int]:
    """Parse hostfile contents; see `parse_hostfile`. ``source`` names the file in errors."""
    hosts: dict[str, int] = {}
    first_line: dict[str, int] = {}
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{source}:{lineno}"
        fields = line.split()
        if len(fields) != 2 or not fields[1].startswith("slots="):
            raise LaunchError(f"{where}: cannot parse {line!r}: {_HOSTFILE_FIX}.")
        host, slots_text = fields[0], fields[1][len("slots="):]
        if not _HOSTNAME.match(host):
            raise LaunchError(f"{where}: {host!r} is not a host name: {_HOSTFILE_FIX}.")
        try:
            slots = int(slots_text)
        except ValueError:
            raise LaunchError(
                f"{where}: slots={slots_text!r} is not an integer: {_HOSTFILE_FIX}."
            ) from None
        if slots < 1:
            raise LaunchError(
                f"{where}: {host} has slots={slots}; a host needs at least one slot. "
                f"Set slots >= 1 or delete the line."
            )
        if host in hosts:
            raise LaunchError(
                f"{where}: host {host} is already listed on line {first_line[host]}. "
                f"List each host once, with its total slots."
            )
        hosts[host] = slots
        first_line[host] = lineno
    if not hosts:
        raise LaunchError(f"{source}: no hosts in the hostfile. {_HOSTFILE_FIX[0].upper()}"
                          f"{_HOSTFILE_FIX[1:]}.")
    return hosts


def parse_filter(spec: str, flag: str = "--include") -> dict[str, list[int] | None]:
    """Parse an ``--include``/``--exclude`` value into ``{host: slots or None (= all)}``.

    Args:
        spec: ``NAME[:SLOT[,SLOT...]]`` entries joined by ``@``.
        flag: the option being parsed, named in errors.

    Raises:
        LaunchError: an empty entry, a bad slot number, or a host given twice.

    Example::

        >>> parse_filter("worker-0@worker-1:0,2")
        {'worker-0': None, 'worker-1': [0, 2]}
    """
    result: dict[str, list[int] | None] = {}
    fix = f"expected {flag} NAME[:SLOT[,SLOT...]][@NAME...], e.g. 'worker-0@worker-1:0,2'"
    for entry in spec.split("@"):
        entry = entry.strip()
        host, sep, slots_text = entry.partition(":")
        if not host or (sep and not slots_text):
            raise LaunchError(f"{flag} {spec!r}: empty entry {entry!r}; {fix}.")
        if host in result:
            raise LaunchError(f"{flag} {spec!r}: host {host} appears twice; {fix}.")
        if not sep:
            result[host] = None
            continue
        slots: list[int] = []
        for s in slots_text.split(","):
            if not s.strip().isdigit():
                raise LaunchError(f"{flag} {spec!r}: slot {s!r} of {host} is not a "
                                  f"non-negative integer; {fix}.")
            if int(s) not in slots:
                slots.append(int(s))
        result[host] = slots
    return result


def _check_filter(pool: dict[str, int], filt: dict[str, list[int] | None], flag: str,
                  source: str) -> None:
    for host, slots in filt.items():
        if host not in pool:
            raise LaunchError(
                f"{flag}: unknown host {host!r}; {source} lists {', '.join(pool)}."
            )
        bad = [s for s in slots or [] if s >= pool[host]]
        if bad:
            raise LaunchError(
                f"{flag}: {host} has slots 0..{pool[host] - 1} in {source}; "
                f"no slot {', '.join(map(str, bad))}."
            )


def select_hosts(
    pool: dict[str, int],
    *,
    include: str | None = None,
    exclude: str | None = None,
    num_nodes: int | None = None,
    num_gpus: int | None = None,
    source: str = "the hostfile",
) -> HostSlots:
    """Apply ``--include``/``--exclude``, then ``--num_nodes``/``--num_gpus``, to a host pool.

    ``--include`` keeps only the named hosts (all their slots, or the listed ones);
    ``--exclude`` drops whole hosts or single slots, and a host left with no slot is dropped.
    Then the first ``num_nodes`` hosts and the first ``num_gpus`` slots of each are kept.

    Args:
        pool: ``{host: slots}`` from `parse_hostfile` (or the local machine).
        include: DeepSpeed include spec, or None.
        exclude: DeepSpeed exclude spec, or None.
        num_nodes: keep this many hosts (None: all).
        num_gpus: keep this many slots per host (None: all).
        source: what the pool came from, named in errors.

    Returns:
        ``{host: [slot, ...]}`` in pool order, every list non-empty and sorted.

    Raises:
        LaunchError: include and exclude together, unknown hosts or slots, more nodes or
            slots asked for than there are, or nothing left to run on.

    Example::

        >>> select_hosts({"a": 4, "b": 4}, exclude="a:1@b")
        {'a': [0, 2, 3]}
    """
    if include and exclude:
        raise LaunchError("--include and --exclude are mutually exclusive; use one of them.")
    selected: HostSlots = {h: list(range(n)) for h, n in pool.items()}
    if include:
        filt = parse_filter(include, "--include")
        _check_filter(pool, filt, "--include", source)
        selected = {h: sorted(filt[h] or range(pool[h])) for h in pool if h in filt}
    elif exclude:
        filt = parse_filter(exclude, "--exclude")
        _check_filter(pool, filt, "--exclude", source)
        for host, slots in filt.items():
            drop = set(range(pool[host])) if slots is None else set(slots)
            selected[host] = [s for s in selected[host] if s not in drop]
        selected = {h: s for h, s in selected.items() if s}
    if not selected:
        raise LaunchError(f"--exclude {exclude!r} leaves no host to run on.")
    if num_nodes is not None:
        if num_nodes < 1:
            raise LaunchError(f"--num_nodes {num_nodes}: need at least one node.")
        if num_nodes > len(selected):
            raise LaunchError(
                f"--num_nodes {num_nodes}, but {source} (after --include/--exclude) has "
                f"{len(selected)} host(s): {', '.join(selected)}. Lower --num_nodes or add hosts."
            )
        selected = dict(list(selected.items())[:num_nodes])
    if num_gpus is not None:
        if num_gpus < 1:
            raise LaunchError(f"--num_gpus {num_gpus}: need at least one process per node.")
        short = [f"{h} ({len(s)})" for h, s in selected.items() if len(s) < num_gpus]
        if short:
            raise LaunchError(
                f"--num_gpus {num_gpus}, but these hosts have fewer usable slots: "
                f"{', '.join(short)}. Lower --num_gpus or raise their slots in {source}."
            )
        selected = {h: s[:num_gpus] for h, s in selected.items()}
    return selected
