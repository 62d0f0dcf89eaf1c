"""Two hosts on separate network stacks (tests/netns.py): the job across them, and the
harness itself. Skips where network namespaces cannot be made (not root, a sandbox)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from netns import PREFIX, Hosts, remove_stale, start_hosts
from test_nodes import BASE, finish, start_nodes

from conftest import assert_bitwise_equal, final_states, kinds
from orchestrator.heartbeat import read_heartbeats

LISTEN = """
import socket, sys, time
s = socket.create_server((sys.argv[1], int(sys.argv[2])))
s.settimeout(1.0)
print("listening", flush=True)
end = time.monotonic() + 60  # bounded: the test kills it long before
while time.monotonic() < end:
    try:
        s.accept()[0].close()
    except TimeoutError:
        pass
"""

CONNECT = """
import socket, sys, time
t0 = time.monotonic()
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=1.0).close()
except OSError as err:
    print(f"failed {type(err).__name__}", flush=True)
    sys.exit(1)
print(f"connected {time.monotonic() - t0:.3f}", flush=True)
"""

PORT = 7311  # host 1's stack is empty: nothing else can hold it


def connect(hosts: Hosts) -> tuple[bool, float]:
    """From host 0, one TCP connect to host 1's listener: (connected, seconds)."""
    p = hosts.popen(0, [sys.executable, "-c", CONNECT, hosts.addr(1), str(PORT)])
    out, _ = p.communicate(timeout=30)
    ok = p.returncode == 0
    return ok, float(out.split()[1]) if ok else 0.0


@pytest.mark.timeout(120)
def test_partition_cuts_the_hosts_apart_and_heal_joins_them(hosts: Hosts) -> None:
    listener = hosts.popen(1, [sys.executable, "-c", LISTEN, hosts.addr(1), str(PORT)])
    assert listener.stdout is not None
    assert listener.stdout.readline().strip() == "listening"  # the script bounds its life
    assert connect(hosts)[0]
    hosts.partition()
    assert not connect(hosts)[0]
    hosts.heal()
    deadline = time.monotonic() + 20
    while not connect(hosts)[0]:  # bounded poll: the bridge port forwards again
        assert time.monotonic() < deadline, "the hosts never joined again after heal()"
    assert listener.pid in hosts.pids(1)
    hosts.kill(1)  # host 1 dies
    assert listener.wait(timeout=30) == -signal.SIGKILL
    assert hosts.pids(1) == []


@pytest.mark.timeout(120)
def test_degrade_delays_every_round_trip(hosts: Hosts) -> None:
    listener = hosts.popen(1, [sys.executable, "-c", LISTEN, hosts.addr(1), str(PORT)])
    assert listener.stdout is not None
    assert listener.stdout.readline().strip() == "listening"
    hosts.degrade(delay_ms=100)  # skips without tc netem
    ok, seconds = connect(hosts)
    assert ok and seconds >= 0.2  # SYN out, SYN-ACK back: 100 ms each way
    hosts.heal()
    ok, seconds = connect(hosts)
    assert ok and seconds < 0.2
    hosts.kill(1)
    listener.wait(timeout=30)


@pytest.mark.timeout(400)
def test_two_hosts_finish_bit_for_bit(tmp_path: Path, hosts: Hosts) -> None:
    """The clean run across two network stacks ends where the same run on loopback does;
    each node is named by its hostname, and nothing keeps running on either host."""
    ref = tmp_path / "loopback"
    for r in finish(start_nodes(ref, BASE, "--steps", "30")):
        assert r.returncode == 0, r.stdout[-3000:]
    d = tmp_path / "run"
    results: list[subprocess.CompletedProcess[str]] = finish(
        start_hosts(hosts, d, BASE, "--steps", "30")
    )
    for r in results:
        assert r.returncode == 0, r.stdout[-3000:]
    assert sorted(p.name for p in (d / "journal").iterdir()) == ["host0.jsonl", "host1.jsonl"]
    starts = sorted(e["details"]["node"] for e in kinds(d, "attempt_start"))
    assert starts == ["host0", "host1"]
    # c10d orders the nodes by address: rank 0 on host 0, as on loopback (127.0.0.1)
    assert [(b["rank"], b["node"]) for b in read_heartbeats(str(d))] == [(0, "host0"), (1, "host1")]
    for a, b in zip(final_states(ref), final_states(d), strict=True):
        assert_bitwise_equal(a, b, "final")
    assert hosts.pids(0) == [] and hosts.pids(1) == []  # workers included


@pytest.mark.timeout(60)
def test_a_crashed_runs_namespaces_are_removed_and_live_ones_kept(hosts: Hosts) -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = f"{PREFIX}{dead.pid}-1-h0"
    subprocess.run(["ip", "netns", "add", stale], check=True, timeout=30)
    try:
        assert stale in remove_stale()
    finally:
        subprocess.run(["ip", "netns", "del", stale], capture_output=True, timeout=30)
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert stale not in listed
    assert all(ns in listed for ns in (hosts.bridge_ns, *hosts.host_ns))  # ours: alive
