"""A warm spare rank (issue 33): a process the node agent starts ahead of need, which has paid
for the interpreter and ``import torch`` already and then waits, so that replacing a dead rank
costs a pipe write rather than a process start (docs/supervisor.md, in place).

    python -u -m orchestrator.spare FD AGENT_PID

It runs nothing of its own: once the agent writes its assignment (JSON: the dead rank's whole
environment, working directory and command) on file descriptor ``FD`` and closes it, the
spare takes that environment and runs the user's script as ``python script.py`` or
``python -m module`` would (``__main__``, ``sys.argv``, ``sys.path[0]``), in this process, so
its exit code and signals are a fresh rank's. End of file without an assignment, or a parent
that is not ``AGENT_PID``, and it exits 0 having run nothing; the agent also starts it with
``PR_SET_PDEATHSIG`` (SIGKILL), as its ranks (orchestrator/agent_ranks.py).

What a process reads only once, at its start, is the same as a fresh rank's by construction:
the agent starts the spare with the ranks' common environment (``OMP_NUM_THREADS``,
``MKL_NUM_THREADS``, ``CUDA_VISIBLE_DEVICES``, ``PYTHON*``, ``LD_*``: read by the interpreter,
libgomp and MKL at load) and the same interpreter flags (``-u``), and hands it only ranks whose
environment differs from that in torchrun's per-rank variables alone
(orchestrator/agent_spare.py); anything else starts a fresh process.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
from typing import Any


def _safe_path() -> bool:
    """``-P`` / ``PYTHONSAFEPATH`` (Python 3.11): no directory is put first on sys.path."""
    return bool(getattr(sys.flags, "safe_path", False))


def preload() -> None:
    """What every rank imports anyway. ``import torch`` does not initialise CUDA (the first
    device call does: ``torch.cuda.init``, a tensor on a GPU), so the ``CUDA_VISIBLE_DEVICES``
    of the assignment still applies; the spare must make no such call here."""
    import torch
    import torch._dynamo  # DDP's constructor imports it: ~200 modules, ~1 s on a 2-core host
    import torch.distributed
    import torch.nn.parallel  # noqa: F401

    import orchestrator.guard
    import orchestrator.rejoin  # noqa: F401


def read_assignment(fd: int) -> dict[str, Any] | None:
    """Block until the agent wrote the assignment and closed its end; None at end of file
    without one (the agent stopped the spare, or died)."""
    chunks = []
    with os.fdopen(fd, "rb", buffering=0) as f:
        while chunk := f.read(1 << 16):
            chunks.append(chunk)
    raw = b"".join(chunks)
    return json.loads(raw) if raw else None


def become(a: dict[str, Any]) -> None:
    """Take the rank's environment, directory and command line, as a fresh process has them.
    ``sys.path[0]``: the script's real directory (the interpreter resolves symlinks), the
    working directory for ``-m``, nothing under ``-P`` / ``PYTHONSAFEPATH``."""
    os.environ.clear()
    os.environ.update(a["env"])
    os.chdir(a["cwd"])
    target = a["target"]
    sys.argv = [target, *a["args"]]  # -m: runpy puts the module's file in argv[0]
    if not _safe_path():
        first = os.getcwd() if a["module"] else os.path.dirname(os.path.realpath(target))
        sys.path.insert(0, first)


def run(a: dict[str, Any]) -> None:
    """The user's script as ``__main__``; its exceptions and ``SystemExit`` end the process
    as they end a fresh interpreter."""
    if a["module"]:
        runpy._run_module_as_main(a["target"], alter_argv=True)  # type: ignore[attr-defined]
    else:
        runpy.run_path(a["target"], run_name="__main__")


def main() -> None:
    fd, agent = int(sys.argv[1]), int(sys.argv[2])
    if os.getppid() != agent:  # the agent died before PR_SET_PDEATHSIG was armed
        sys.exit(0)
    if not _safe_path():
        # Our own -m put the agent's directory first: the preloaded modules resolve as a
        # fresh rank's do, from PYTHONPATH and site-packages (a module of the script's own
        # directory that shadows one of them is the one case that differs).
        del sys.path[0]
    preload()
    a = read_assignment(fd)
    if a is None or os.getppid() != agent:
        sys.exit(0)
    become(a)
    run(a)


if __name__ == "__main__":
    main()
