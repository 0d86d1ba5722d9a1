"""A two-node cluster on one machine: two network namespaces joined by a rate-limited veth pair,
each running one `zeroshard launch --node_rank R` with its own ranks.

    sudo python bench/two_node.py [--rate 1gbit] [--delay-ms 1] [--nproc-per-node 2] \
        -- SCRIPT [ARGS...]
    sudo python bench/two_node.py --rate none -- SCRIPT        # same layout, link not shaped

Layout (see bench/zeropp.md): namespace `zsnode<pid>a` holds node 0 at 10.213.<k>.1, namespace
`zsnode<pid>b` node 1 at 10.213.<k>.2, on a /30 that exists only on the veth pair, with no
default route: nothing can leave the machine. Each namespace has its own loopback; ranks of one
node talk to each other through their own address, which the kernel routes over that
namespace's loopback, so only inter-node traffic crosses the shaped veth. gloo is pinned to the
veth (`GLOO_SOCKET_IFNAME`) so it never picks another interface.

Shaping: `tc` on the egress of both veth ends, so each direction is limited to `--rate`.
`netem` (rate + delay) is used when the kernel has it; otherwise `tbf` (rate only) and the
delay is reported as unavailable. Everything created is deleted on exit (deleting a namespace
deletes its veth end and its qdisc), also on error or Ctrl-C.

Needs root and `ip netns`; without them `unavailable()` says why and the CLI exits 3.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SKIP_EXIT = 3
"""Exit status of the CLI when the machine cannot host the cluster (not root, no ip netns)."""


def unavailable() -> str | None:
    """Why this machine cannot build the cluster, or None when it can."""
    if os.name != "posix" or not hasattr(os, "geteuid"):
        return "needs Linux network namespaces"
    if os.geteuid() != 0:
        return "needs root (ip netns add, tc); run it with sudo"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"needs the `{tool}` command (iproute2)"
    probe = f"zsprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _sh(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True)


def _must(*argv: str) -> None:
    done = _sh(*argv)
    if done.returncode != 0:
        raise RuntimeError(f"`{' '.join(argv)}` failed: {done.stderr.strip()}")


@dataclass
class TwoNodeCluster:
    """Context manager owning two namespaces, one veth pair and its qdiscs.

    Args:
        rate: tc rate of each direction of the inter-node link (e.g. "1gbit"), or None for an
            unshaped link.
        delay_ms: one-way delay added with netem when the kernel has it (0: none).
    """

    rate: str | None = "1gbit"
    delay_ms: float = 0.0
    shaping: str = field(default="none", init=False)
    """What was installed: "netem rate+delay", "tbf rate" or "none"."""

    def __post_init__(self) -> None:
        tag = f"{os.getpid() % 100000}"
        self.namespaces = (f"zsnode{tag}a", f"zsnode{tag}b")
        self.devices = (f"zsv{tag}a", f"zsv{tag}b")
        third = 16 + os.getpid() % 200  # a /30 per run, so two runs at once do not collide
        self.addresses = (f"10.213.{third}.1", f"10.213.{third}.2")

    def __enter__(self) -> TwoNodeCluster:
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _build(self) -> None:
        for ns in self.namespaces:
            _must("ip", "netns", "add", ns)
        _must("ip", "link", "add", self.devices[0], "type", "veth", "peer", "name", self.devices[1])
        for ns, dev, addr in zip(self.namespaces, self.devices, self.addresses):
            _must("ip", "link", "set", dev, "netns", ns)
            _must("ip", "-n", ns, "addr", "add", f"{addr}/30", "dev", dev)
            _must("ip", "-n", ns, "link", "set", dev, "up")
            _must("ip", "-n", ns, "link", "set", "lo", "up")
        if self.rate is not None:
            for ns, dev in zip(self.namespaces, self.devices):
                self.shaping = self._shape(ns, dev)

    def _shape(self, ns: str, dev: str) -> str:
        base = ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root"]
        netem = base + ["netem", "rate", str(self.rate)]
        if self.delay_ms:
            netem += ["delay", f"{self.delay_ms}ms"]
        if _sh(*netem).returncode == 0:
            return "netem rate" + ("+delay" if self.delay_ms else "")
        # No netem in this kernel: a token bucket shapes the rate; the burst is one 64 KiB GSO
        # segment plus slack, so the average rate holds even for large segments.
        _must(*base, "tbf", "rate", str(self.rate), "burst", "256kb", "latency", "100ms")
        return "tbf rate (netem unavailable: no added delay)"

    def link_tx_bytes(self) -> tuple[int, int]:
        """Bytes each node has sent over the inter-node link so far (the veth counters)."""
        counts = []
        for ns, dev in zip(self.namespaces, self.devices):
            done = _sh("ip", "netns", "exec", ns, "cat", f"/sys/class/net/{dev}/statistics/tx_bytes")
            counts.append(int(done.stdout.strip() or 0))
        return counts[0], counts[1]

    def close(self) -> None:
        """Delete the namespaces (and with them the veth pair and its qdiscs). Idempotent."""
        for ns in self.namespaces:
            _sh("ip", "netns", "del", ns)
        _sh("ip", "link", "del", self.devices[0])  # only if it never moved into a namespace

    def launch(self, node_rank: int, script_argv: Sequence[str], nproc_per_node: int = 2,
               master_port: int = 29611, env: dict[str, str] | None = None
               ) -> subprocess.Popen[str]:
        """Start `zeroshard launch` for one node inside its namespace."""
        ns, dev = self.namespaces[node_rank], self.devices[node_rank]
        child_env = {**os.environ, "PYTHONPATH": str(REPO), "GLOO_SOCKET_IFNAME": dev,
                     "OMP_NUM_THREADS": "1", **(env or {})}
        argv = ["ip", "netns", "exec", ns, sys.executable, "-m", "zeroshard.cli.launch",
                "--num_nodes", "2", "--node_rank", str(node_rank),
                "--nproc_per_node", str(nproc_per_node), "--master_addr", self.addresses[0],
                "--master_port", str(master_port), "--no_env_file", *script_argv]
        return subprocess.Popen(argv, env=child_env, cwd=REPO, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True)

    def run(self, script_argv: Sequence[str], nproc_per_node: int = 2, timeout_s: float = 300,
            env: dict[str, str] | None = None) -> list[tuple[int, str]]:
        """Run both nodes to completion; returns (exit status, output) per node."""
        procs = [self.launch(r, script_argv, nproc_per_node, env=env) for r in (0, 1)]
        deadline = time.monotonic() + timeout_s
        results: list[tuple[int, str]] = []
        for p in procs:
            try:
                out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                out, _ = p.communicate()
                out += f"\n[two_node] killed after {timeout_s} s"
            results.append((p.returncode, out))
        return results


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", default="1gbit",
                        help="tc rate per direction of the inter-node link, or 'none'")
    parser.add_argument("--delay-ms", type=float, default=1.0,
                        help="one-way delay when the kernel has netem (default 1)")
    parser.add_argument("--nproc-per-node", type=int, default=2)
    parser.add_argument("--timeout-s", type=float, default=300)
    parser.add_argument("script", nargs=argparse.REMAINDER, help="-- SCRIPT [ARGS...]")
    args = parser.parse_args(argv)
    script = list(args.script[1:] if args.script[:1] == ["--"] else args.script)
    if not script:
        parser.error("give the script to run after --")
    why = unavailable()
    if why is not None:
        print(f"SKIP two-node cluster: {why}", file=sys.stderr)
        return SKIP_EXIT
    rate = None if args.rate == "none" else args.rate
    with TwoNodeCluster(rate=rate, delay_ms=args.delay_ms) as cluster:
        print(f"[two_node] nodes {cluster.addresses} in {cluster.namespaces}, "
              f"link {rate or 'unshaped'} ({cluster.shaping})", flush=True)
        results = cluster.run(script, args.nproc_per_node, args.timeout_s)
        tx = cluster.link_tx_bytes()
    for node, (code, out) in enumerate(results):
        print(f"--- node {node} (exit {code})\n{out}", flush=True)
    print(f"[two_node] inter-node bytes sent: node0->node1 {tx[0]}, node1->node0 {tx[1]}")
    return max(abs(code) for code, _ in results)


if __name__ == "__main__":
    sys.exit(main())
