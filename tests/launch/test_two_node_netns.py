"""bench/two_node.py: two `zeroshard launch` nodes in two network namespaces, 2 ranks each,
joined by a veth pair. Skips (with the reason) where the machine cannot make namespaces."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

from two_node import TwoNodeCluster, _sh, unavailable  # noqa: E402  bench/two_node.py loads after the sys.path insert

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


def _read_lines(proc: subprocess.Popen[str], into: list[tuple[float, str]]) -> threading.Thread:
    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            into.append((time.monotonic(), line))

    thread = threading.Thread(target=pump, daemon=True)
    thread.start()
    return thread


@pytest.mark.skipif(WHY is not None, reason=f"two-node cluster: {WHY}")
def test_a_node_cut_off_the_network_is_named_on_both_sides() -> None:
    """Node 1's link goes down while both nodes' ranks all-reduce (a 120 s collective timeout):
    nothing closes, so gloo alone would wait the whole timeout. Rank 0 (beside the store) names
    rank 1 silent; rank 1, which cannot reach the store on node 0 any more, names the store
    (Note: [peer silence], Note: [store silence] in comm/silence.py); each within seconds. The two
    namespaces share this machine's /dev/shm and host name, so the shared-memory routes that real
    nodes could not use are switched off: every byte and check goes over the link, as between hosts."""
    script = str(REPO / "tests" / "launch" / "scripts" / "link_drop.py")
    env = {"ZEROSHARD_PEER_SILENCE_S": "3", "ZEROSHARD_COMM_SHM": "0", "ZEROSHARD_COMM_CHECK_BOARD": "0"}
    with TwoNodeCluster(rate=None) as cluster:
        procs = [cluster.launch(r, [script], nproc_per_node=1, env=env) for r in (0, 1)]
        outputs: list[list[tuple[float, str]]] = [[], []]
        readers = [_read_lines(p, out) for p, out in zip(procs, outputs)]
        try:
            deadline = time.monotonic() + 180
            while not all(any("READY" in line for _, line in out) for out in outputs):
                assert time.monotonic() < deadline and all(p.poll() is None for p in procs), outputs
                time.sleep(0.2)
            time.sleep(1.0)  # a few all-reduces over the link
            _sh("ip", "-n", cluster.namespaces[1], "link", "set", cluster.devices[1], "down")
            dropped = time.monotonic()

            def named(node: int, pattern: str) -> re.Match[str] | None:
                return next((m for _, line in outputs[node] if (m := re.search(pattern, line))), None)

            silent_peer = (r"CommError: rank 0: waited (\d+) s in all_reduce .*rank 1 \(host \S+, pid \d+\) "
                           r"silent for (\d+) s")
            silent_store = (rf"CommError: rank 1: waited (\d+) s in all_reduce .*the c10d store at "
                            rf"{re.escape(cluster.addresses[0])}:\d+ has not answered for (\d+) s")
            while not (named(0, silent_peer) and named(1, silent_store)):
                assert time.monotonic() < dropped + 60, ["".join(x for _, x in out)[-6000:] for out in outputs]
                time.sleep(0.2)
            took = max(t for out in outputs for t, line in out if "CommError" in line) - dropped
        finally:
            for p in procs:
                p.kill()
            for r in readers:
                r.join(timeout=10)
    for node, pattern in ((0, silent_peer), (1, silent_store)):
        m = named(node, pattern)
        assert m is not None and 3 <= int(m.group(2)) < 30 and int(m.group(1)) < 40, m and m.group(0)
    assert took < 40, f"named {took:.0f} s after the link went down (collective timeout 120 s)"
    print(f"both sides named within {took:.1f} s of the link going down")


@pytest.mark.skipif(WHY is not None, reason=f"two-node cluster: {WHY}")
def test_a_node_cut_off_the_network_leaves_and_the_job_finishes_without_it(tmp_path: Path) -> None:
    """test_elastic_launch's lost node over a real link: two `zeroshard launch --nnodes 1:2
    --max-restarts 1` nodes in the namespaces, one rank each, training scripts/elastic_train.py at
    ZeRO 2 with auto-resume; both hold before step 6, node 1's link goes down, training goes on.
    Node 0's rank names rank 1 silent and exits; its agent gives the lost node's heartbeat up and
    restarts its worker at world size 1, which resumes from step 4 with gradient accumulation 2 and
    equals an uninterrupted world-1 run from that checkpoint (1e-6 relative). Node 1's rank, cut off,
    names the store instead of waiting out the collective timeout."""
    import test_elastic_launch as el  # its helpers (and its torch import) for this case only

    env = {**el._env(), "ZEROSHARD_PEER_SILENCE_S": "3", "ZEROSHARD_COMM_SHM": "0",
           "ZEROSHARD_COMM_CHECK_BOARD": "0", "ZS_HOLD": "6"}
    with TwoNodeCluster(rate=None) as cluster:
        jobs = []
        try:
            for node, host in ((0, "true"), (1, "false")):
                argv = ["ip", "netns", "exec", cluster.namespaces[node], sys.executable, "-m", "zeroshard.cli.main",
                        "launch", "--nnodes", "1:2", "--nproc_per_node", "1", "--max-restarts", "1",
                        "--master_addr", cluster.addresses[0], "--master_port", "29612", "--rdzv_id", "cut",
                        "--local_addr", cluster.addresses[node],  # both namespaces have this host's name
                        "--rdzv_conf", f"{el.RDZV_CONF},is_host={host}", str(el.SCRIPT), str(tmp_path), "2"]
                jobs.append(el._Job(subprocess.Popen(
                    argv, cwd=REPO, env={**env, "GLOO_SOCKET_IFNAME": cluster.devices[node]}, text=True,
                    start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)))
            for job in jobs:
                job.wait_for(r"^HOLD rank \d world 2 ")
            _sh("ip", "-n", cluster.namespaces[1], "link", "set", cluster.devices[1], "down")
            cut = time.time()
            (tmp_path / "go").touch()
            code, out = jobs[0].finish()
            lost_out = jobs[1].out
        finally:
            for job in jobs:
                job.kill()
    assert code == 0, out[-6000:]
    assert re.search(r"CommError: rank 0: waited \d+ s in \S+ .*rank 1 \(host \S+, pid \d+\) silent for \d+ s", out), (
        out[-6000:])
    assert re.search(rf"CommError: rank 1: waited \d+ s .*the c10d store at {re.escape(cluster.addresses[0])}:\d+ "
                     r"has not answered", lost_out), lost_out[-6000:]
    resumed = r"^START rank 0/1 attempt 1 step 4 gas 2 "
    assert re.search(resumed, out, re.M), out[-4000:]
    assert ("zeroshard launch: 1 restart (--max_restarts 1): attempt 0 failed, attempt 1 finished. "
            "Exit status 0.") in out, out[-3000:]
    lost_steps = el._record(lost_out + out, 2, 1, 4)
    assert lost_steps == [5], lost_steps
    back = el._stamp(out, resumed[1:].rstrip()) - cut
    el._report("node cut off the network", 2, "2 -> 1", 4, lost_steps, f"training again {back:.1f} s after the "
               "link went down", el._step_losses(out, 1), el._reference(tmp_path, 2, 1, "global_step4", 2))
