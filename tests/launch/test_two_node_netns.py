"""bench/two_node.py: two `zeroshard launch` nodes in two network namespaces, 2 ranks each,
joined by a veth pair. Skips (with the reason) where the machine cannot make namespaces."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

from two_node import TwoNodeCluster, unavailable  # noqa: E402  bench/two_node.py loads after the sys.path insert

WHY = unavailable()


@pytest.mark.skipif(WHY is not None, reason=f"two-node cluster: {WHY}")
def test_four_ranks_on_two_namespaced_nodes_all_reduce_over_the_veth() -> None:
    script = str(REPO / "tests" / "launch" / "scripts" / "allreduce.py")
    with TwoNodeCluster(rate="1gbit") as cluster:
        namespaces = cluster.namespaces
        results = cluster.run([script], nproc_per_node=2, timeout_s=180)
        tx = cluster.link_tx_bytes()
    for node, (code, out) in enumerate(results):
        assert code == 0, out
        for local in (0, 1):
            rank = 2 * node + local
            assert f"ALLREDUCE rank={rank} world=4 local_rank={local} value=10" in out, out
    # The nodes really talked over the link (rendezvous + the all-reduce), both ways.
    assert tx[0] > 0 and tx[1] > 0, tx
    # Teardown removed what it made.
    import subprocess
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(ns in listed for ns in namespaces), listed


@pytest.mark.skipif(WHY is not None, reason=f"two-node cluster: {WHY}")
def test_zeropp_node_layout_from_the_launcher() -> None:
    """`zeroshard launch --num_nodes 2` gives each rank LOCAL_WORLD_SIZE=2: hpZ takes its node
    groups from it (no override), forward/backward gather nothing across the veth, and
    hierarchical qgZ moves 1/s of one-level int4 across (bench/zeropp.md has the full table)."""
    script = str(REPO / "bench" / "zeropp_step.py")
    with TwoNodeCluster(rate=None) as cluster:
        results = cluster.run([script, "--steps", "2", "--hpz", "--qgz", "--preset", "tiny"],
                              nproc_per_node=2, timeout_s=240)
    code, out = results[0]
    assert code == 0, out
    line = next(x for x in out.splitlines() if x.startswith("ZEROPP_STEP"))
    fields = dict(kv.split("=") for kv in line.split()[1:])
    assert fields["world"] == "4" and fields["node"] == "2", line
    assert float(fields["gather_MB_inter_node"]) == 0.0 and float(fields["gather_MB_inter_cross"]) > 0, line
    assert float(fields["grad_MB_inter"]) < float(fields["grad_MB_intra"]), line
