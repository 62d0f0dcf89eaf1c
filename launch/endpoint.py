"""The launcher's rendezvous endpoint: where it is, whether this node can reach it.

torchrun's c10d rendezvous (and its static one, and the ``deepspeed`` launcher's, and an
``srun`` job's ``MASTER_ADDR``) meets at one TCP endpoint, served from the launcher of one
node: that node holds the job's store. An attempt that cannot reach it fails after the
launcher's own timeout, which says nothing about the training itself, so the supervisor
looks before it starts one and after one fails (launch/cluster.py): an unreachable
endpoint counts toward ``supervisor.node_timeout_s`` (exit 77), never toward the crash loop.

"Reachable" means the host answers: a connection accepted, or refused because the store is
not up yet (its node's launcher starts with ours). Only a timeout, "no route" or "network
unreachable" mean the network between the nodes is cut.
"""

from __future__ import annotations

import contextlib
import errno
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

# The launchers' default ports: torchrun's c10d rendezvous, and MASTER_PORT's.
C10D_PORT, MASTER_PORT = 29400, 29500
PROBE_TIMEOUT_S = 3.0
_CUT = {errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ETIMEDOUT, errno.EHOSTDOWN}


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def _split(value: str, default_port: int) -> Endpoint:
    """``host``, ``host:port``, ``[v6]:port``."""
    if value.startswith("["):
        host, _, rest = value[1:].partition("]")
        port = rest.lstrip(":")
    elif value.count(":") == 1:
        host, _, port = value.partition(":")
    else:
        host, port = value, ""
    return Endpoint(host, int(port) if port.isdigit() else default_port)


def _option(cmd: Sequence[str], *names: str) -> str | None:
    for i, arg in enumerate(cmd):
        name, eq, value = arg.partition("=")
        if name in names:
            return value if eq else (cmd[i + 1] if i + 1 < len(cmd) else None)
    return None


def launcher_endpoint(cmd: Sequence[str], env: Mapping[str, str]) -> Endpoint | None:
    """The endpoint the launcher command meets at: torchrun's ``--rdzv-endpoint`` (or its
    ``--master-addr``/``--master-port`` without one), the ``deepspeed`` launcher's
    ``--master_addr``/``--master_port``, else ``MASTER_ADDR``/``MASTER_PORT`` from the
    environment (``srun``). None for a one-node launcher (``--standalone``) or none given."""
    if "--standalone" in cmd:
        return None
    rdzv = _option(cmd, "--rdzv-endpoint", "--rdzv_endpoint")
    if rdzv:
        return _split(rdzv, C10D_PORT)
    addr = _option(cmd, "--master-addr", "--master_addr") or env.get("MASTER_ADDR")
    if not addr:
        return None
    port = _option(cmd, "--master-port", "--master_port") or env.get("MASTER_PORT", "")
    return Endpoint(addr, int(port) if port.isdigit() else MASTER_PORT)


def is_local(host: str) -> bool:
    """Whether ``host`` is an address of this machine (this node holds the store): an
    address this host can bind. Loopback counts, which is right for nodes simulated on one
    machine (every one of them reaches 127.0.0.1)."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    for family, _, _, _, addr in infos:
        with contextlib.suppress(OSError), socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((addr[0], 0))
            return True
    return False


def route_addr(host: str) -> str | None:
    """This machine's address on the way to ``host`` (what the others see us as): a UDP
    socket's local address once connected, which sends nothing."""
    try:
        family, _, _, _, addr = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(addr)
            return str(s.getsockname()[0])
    except OSError:
        return None


def unreachable(ep: Endpoint, timeout_s: float = PROBE_TIMEOUT_S) -> str | None:
    """Why ``ep``'s host cannot be reached from here, or None when it answers (accepted or
    refused: its launcher may not have started yet)."""
    try:
        with socket.create_connection((ep.host, ep.port), timeout=timeout_s):
            return None
    except ConnectionRefusedError:
        return None
    except socket.gaierror as err:
        return f"{ep.host} does not resolve here ({err.strerror})"
    except TimeoutError:
        return f"no answer from {ep} within {timeout_s:g} s"
    except OSError as err:
        if err.errno in _CUT:
            return f"{ep}: {err.strerror}"
        return None  # anything else is the host answering in its own way
