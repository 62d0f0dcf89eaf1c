"""Two hosts on separate network stacks on one machine: a test harness.

Each host is a network namespace with its own hostname (a UTS namespace) and its own
/etc/hosts (a mount namespace); the two are joined by veth pairs to a bridge that lives in
a third namespace, so nothing in the root namespace's network changes. The file system is
shared (a run directory under tmp_path is seen by both hosts, as on a cluster's shared
storage). Processes in host ``i`` reach the other host only at its veth address.

    def test_x(hosts: Hosts) -> None:          # the fixture (registered in conftest)
        p = hosts.popen(1, [sys.executable, "server.py"])
        hosts.partition(); ...; hosts.heal()
        hosts.kill(1)                          # host 1 dies: SIGKILL all it runs

Needs root, ``ip`` and ``unshare`` (iproute2, util-linux); the fixture skips, naming the
reason, where namespaces cannot be made. ``degrade`` also needs tc's netem qdisc (the
kernel's sch_netem; gVisor has none) and skips without it.

Names: ``onet<pid>-<n>-{br,h0,h1}``, so parallel runs never clash; namespaces a crashed
run left behind (their pid gone) are removed when the next harness starts.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from conftest import EXAMPLE, REPO, free_port

PREFIX = "onet"
SUBNET = "10.213.0"  # private, and only ever configured inside our own namespaces
IFNAME = "eth0"  # each host's veth end, inside its namespace (GLOO_SOCKET_IFNAME)
BRIDGE = "br0"
_NAME = re.compile(rf"^{PREFIX}(\d+)-(\d+)-(br|h\d+)$")
_counter = 0


class NetnsUnavailable(Exception):
    """Namespaces cannot be made here (not root, no ``ip``, a sandbox that refuses)."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed ({r.returncode}): {r.stderr.strip()}")
    return r


def _namespaces() -> list[str]:
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _pids(ns: str) -> list[int]:
    out = _ip("netns", "pids", ns, check=False).stdout
    return [int(p) for p in out.split()]


def _kill_all(ns: str, timeout_s: float = 10.0) -> None:
    """SIGKILL every process in ``ns`` until none is left (a dying one may have forked)."""
    deadline = time.monotonic() + timeout_s
    while pids := _pids(ns):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes {pids} in namespace {ns} survived SIGKILL")
        time.sleep(0.05)


def _remove(ns: str) -> None:
    _kill_all(ns)
    _ip("netns", "del", ns, check=False)


def remove_stale() -> list[str]:
    """Delete our namespaces whose creating process is gone (a crashed or killed run)."""
    removed = []
    for ns in _namespaces():
        m = _NAME.match(ns)
        if m and not Path(f"/proc/{m.group(1)}").exists():
            _remove(ns)
            removed.append(ns)
    for d in Path(tempfile.gettempdir()).glob(f"{PREFIX}*-*-*"):  # their /etc/hosts files
        m = _NAME.match(d.name.rsplit("-", 1)[0] + "-br")
        if m and not Path(f"/proc/{m.group(1)}").exists():
            shutil.rmtree(d, ignore_errors=True)
    return removed


def _check_available() -> None:
    if os.geteuid() != 0:
        raise NetnsUnavailable("network namespaces need root")
    for tool in ("ip", "unshare", "hostname", "mount"):
        if shutil.which(tool) is None:
            raise NetnsUnavailable(f"no `{tool}` on PATH (iproute2 / util-linux)")
    if not Path("/etc/hosts").is_file():
        raise NetnsUnavailable("no /etc/hosts to bind each host's own over")


class Hosts:
    """Two hosts, ``host0`` at ``SUBNET.1`` and ``host1`` at ``SUBNET.2``, on one bridge.

    Made by :func:`two_hosts` (or the ``hosts`` fixture); every method may be called
    until its ``with`` block ends.
    """

    def __init__(self, tag: str, workdir: Path) -> None:
        self.tag = tag
        self.bridge_ns = f"{tag}-br"
        self.host_ns = [f"{tag}-h0", f"{tag}-h1"]
        self.names = ["host0", "host1"]
        self.ifname = IFNAME
        self._workdir = workdir
        self._hosts_file = workdir / "hosts"
        self.netem = shutil.which("tc") is not None

    # --- building and removing -------------------------------------------------------------

    def _build(self) -> None:
        br = self.bridge_ns
        try:
            _ip("netns", "add", br)
        except RuntimeError as err:
            raise NetnsUnavailable(f"`ip netns add` refused: {err}") from err
        for ns in self.host_ns:
            _ip("netns", "add", ns)
        _ip("-n", br, "link", "set", "lo", "up")
        _ip("-n", br, "link", "add", BRIDGE, "type", "bridge")
        _ip("-n", br, "link", "set", BRIDGE, "up")
        for i, ns in enumerate(self.host_ns):
            # Made in the bridge's namespace with its peer born in the host's: no interface
            # ever appears in the root namespace.
            _ip("-n", br, "link", "add", f"h{i}", "type", "veth", "peer", "name", IFNAME,
                "netns", ns)  # fmt: skip
            _ip("-n", br, "link", "set", f"h{i}", "master", BRIDGE)
            _ip("-n", br, "link", "set", f"h{i}", "up")
            _ip("-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", IFNAME)
            _ip("-n", ns, "link", "set", IFNAME, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        # Each host resolves both names (torch's c10d rendezvous calls
        # getaddrinfo(gethostname()) to learn whether it hosts the store).
        lines = ["127.0.0.1 localhost"] + [f"{self.addr(i)} {n}" for i, n in enumerate(self.names)]
        self._hosts_file.write_text("\n".join(lines) + "\n")

    def _teardown(self) -> None:
        errors = []
        for ns in (*self.host_ns, self.bridge_ns):  # the bridge's last: veths go with it
            if ns in _namespaces():
                try:
                    _remove(ns)
                except RuntimeError as err:
                    errors.append(str(err))
        shutil.rmtree(self._workdir, ignore_errors=True)
        left = [ns for ns in _namespaces() if ns.startswith(self.tag + "-")]
        if errors or left:
            raise RuntimeError(f"could not remove namespaces {left}: {errors}")

    # --- the API ---------------------------------------------------------------------------

    def addr(self, i: int) -> str:
        """Host ``i``'s address (its veth, ``IFNAME`` inside its namespace)."""
        return f"{SUBNET}.{i + 1}"

    def wrap(self, i: int, cmd: list[str]) -> list[str]:
        """``cmd`` as run inside host ``i``: its network namespace, its hostname, its
        /etc/hosts (private mount namespace, so nothing leaks to the root's)."""
        script = 'hostname "$1" && mount --bind "$2" /etc/hosts && shift 2 && exec "$@"'
        return ["ip", "netns", "exec", self.host_ns[i], "unshare", "--uts", "--mount",
                "sh", "-c", script, "sh", self.names[i], str(self._hosts_file), *cmd]  # fmt: skip

    def popen(
        self, i: int, cmd: list[str], env: dict[str, str] | None = None, **kwargs: Any
    ) -> subprocess.Popen[str]:
        """Start ``cmd`` on host ``i`` in a new session (``os.killpg(p.pid, ...)`` reaches
        its whole group), output captured as text unless ``kwargs`` say otherwise.

        ``env`` replaces the environment (default: this process's). The pid is ``cmd``'s
        own: ``ip netns exec``, ``unshare`` and ``sh`` each exec into the next.
        """
        opts: dict[str, Any] = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT,
                                "text": True, "cwd": REPO, **kwargs}  # fmt: skip
        return subprocess.Popen(self.wrap(i, cmd), env=env, start_new_session=True, **opts)

    def pids(self, i: int) -> list[int]:
        """The processes running in host ``i``'s network namespace."""
        return _pids(self.host_ns[i])

    def kill(self, i: int) -> None:
        """Host ``i`` dies: SIGKILL everything in its namespace, until none is left."""
        _kill_all(self.host_ns[i])

    def partition(self) -> None:
        """Cut the hosts apart: their bridge ports leave the bridge. Each host's own link
        stays up (carrier and addresses unchanged, as when a switch between them fails);
        frames are dropped silently, so connections time out rather than fail fast."""
        for i in range(len(self.host_ns)):
            _ip("-n", self.bridge_ns, "link", "set", f"h{i}", "nomaster")

    def heal(self) -> None:
        """Join the hosts again (undoes :meth:`partition` and :meth:`degrade`)."""
        for i in range(len(self.host_ns)):
            _ip("-n", self.bridge_ns, "link", "set", f"h{i}", "master", BRIDGE)
            if self.netem:
                subprocess.run(["tc", "-n", self.bridge_ns, "qdisc", "del", "dev", f"h{i}",
                                "root"], capture_output=True, timeout=30)  # fmt: skip

    def degrade(self, delay_ms: float = 0.0, loss_pct: float = 0.0) -> None:
        """Delay and drop packets each way (tc netem on both bridge ports: a round trip
        takes 2 x ``delay_ms`` more). Skips the test where netem is not available."""
        if not self.netem:
            pytest.skip("degrade needs `tc` (iproute2)")
        for i in range(len(self.host_ns)):
            cmd = ["tc", "-n", self.bridge_ns, "qdisc", "replace", "dev", f"h{i}", "root",
                   "netem", "delay", f"{delay_ms}ms", "loss", f"{loss_pct}%"]  # fmt: skip
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
            if r.returncode != 0:
                self.netem = False
                pytest.skip(f"degrade needs tc netem (sch_netem): {r.stderr.strip()}")


@contextlib.contextmanager
def two_hosts() -> Iterator[Hosts]:
    """Make the two hosts; remove them, and kill whatever still runs on them, on exit.

    Raises:
        NetnsUnavailable: namespaces cannot be made here (the fixture skips on it).
    """
    global _counter
    _check_available()
    remove_stale()
    _counter += 1
    tag = f"{PREFIX}{os.getpid()}-{_counter}"
    hosts = Hosts(tag, Path(tempfile.mkdtemp(prefix=f"{tag}-")))
    try:
        hosts._build()
        yield hosts
    finally:
        hosts._teardown()


@pytest.fixture
def hosts() -> Iterator[Hosts]:
    """Two hosts on separate network stacks (see :class:`Hosts`); skips where they cannot
    be made."""
    try:
        with two_hosts() as h:
            yield h  # a failing test is not thrown in here: the with block always ends
    except NetnsUnavailable as err:
        pytest.skip(f"two hosts need network namespaces: {err}")


def start_hosts(
    hosts: Hosts,
    run_dir: Path,
    policy: dict[str, Any],
    *args: str,
    port: int | None = None,
    launcher: tuple[str, ...] = (),
) -> list[subprocess.Popen[str]]:
    """One supervisor per host (as ``test_nodes.start_nodes``, but each on its own network
    stack): a 2-node job, one rank per node, c10d rendezvous on host 0's address. The node
    names are the hostnames (no ORCHESTRATOR_NODE), gloo uses the veth. ``port``: the
    rendezvous port (give the same one to start the same commands again); ``launcher``:
    more torchrun options."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir.parent / f"{run_dir.name}-policy.yaml"
    path.write_text(yaml.safe_dump(policy))
    port = port or free_port()  # free in the root namespace; host 0's stack has nothing bound
    env = {k: v for k, v in os.environ.items() if k != "ORCHESTRATOR_NODE"}
    procs = []
    for i in range(2):
        cmd = [sys.executable, "-m", "launch.cli", "launch", "--policy", str(path),
               "--run-dir", str(run_dir), "--", sys.executable, "-m", "torch.distributed.run",
               "--nnodes", "2", "--node-rank", str(i), "--nproc-per-node", "1",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{hosts.addr(0)}:{port}",
               "--rdzv-id", run_dir.name, "--local-addr", hosts.addr(i), *launcher,
               str(EXAMPLE), *args,
               "--save-final", str(run_dir / "final")]  # fmt: skip
        own = {**env, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": hosts.ifname}
        procs.append(hosts.popen(i, cmd, env=own))
    return procs
