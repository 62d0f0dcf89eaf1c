"""The contract between the node agent and its ranks for in-place recovery (issue 33).

A dead or hung rank is replaced alone: the agent (``orchestrator.agent``, the launcher of one
attempt under ``orchestrator launch --nproc-per-node N``) kills it, starts a replacement, and
the survivors leave the broken collective, re-form the process group with the replacement in
the same processes, and roll back together. Design and measurements:
docs/dev/issue-33-design.md. This module is the whole contract, so both sides read it here:
torch-free (the agent and the launcher import it too), no behaviour beyond (de)serialising.

Two stores:

- the **control store**: a ``TCPStore`` the agent hosts for the whole attempt, at
  ``ORCHESTRATOR_CONTROL_ADDR``:``ORCHESTRATOR_CONTROL_PORT``; it outlives generations.
- one **group store per generation**: a fresh ``TCPStore`` the agent starts for each
  generation; ranks see it as ``MASTER_ADDR``:``MASTER_PORT`` (with
  ``TORCHELASTIC_USE_AGENT_STORE=True``, so the user's own ``init_process_group(env://)``
  opens a client to it, as under torchrun). A fresh store per generation is what lets a
  replacement's unchanged script join generation ``g+1`` rather than ``g``'s stale keys;
  survivors join it with :data:`PG_PREFIX`, the prefix an env:// init adds.

Generation 0 is the attempt's start. When rank(s) die or hang in generation ``g`` the agent
writes :func:`next_key` ``(g)`` once: either a :class:`NextGeneration` (the port of
``g+1``'s group store and the replaced ranks) or a fallback (a reason: the agent stops every
rank and the supervisor restarts the attempt as before). A survivor that caught a
collective's error waits on that one key (``store.wait`` waits for all keys it is given, so
one key carries both outcomes), at most :data:`NEXT_WAIT_S` when no policy says otherwise.
Every rank of ``g+1`` (survivors and replacements) then ``add`` s 1 to :func:`joined_key`
``(g+1)`` once its group is formed and its state healed; the agent falls back when the count
does not reach the world size within the heal timeout.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Literal

# Environment the agent sets on every rank, besides torchrun's own variables.
ENV_INPLACE = "ORCHESTRATOR_INPLACE"  # "1": the rank runs under the agent; in-place is on
ENV_CONTROL_ADDR = "ORCHESTRATOR_CONTROL_ADDR"
ENV_CONTROL_PORT = "ORCHESTRATOR_CONTROL_PORT"
ENV_GENERATION = "ORCHESTRATOR_INPLACE_GEN"  # the generation this process was started in

PG_PREFIX = "default_pg"  # what init_process_group(env://) prefixes its keys with
NEXT_WAIT_S = 60.0  # a survivor's wait for the agent's word after a collective's error

Cause = Literal["exit", "signal", "hang"]


@dataclass(frozen=True)
class NextGeneration:
    """What :func:`next_key` holds: the agent's decision after generation ``gen - 1`` broke."""

    gen: int  # the new generation (g + 1); 0 with ``fallback`` set
    port: int  # its group store's port on the control store's host; 0 with ``fallback``
    replaced: tuple[int, ...]  # global ranks started again (the others are survivors)
    cause: Cause | None  # why they were replaced
    fallback: str | None = None  # set: no in-place recovery, every rank is stopped (why)
    time: float = 0.0  # when the agent decided (time.time())

    def encode(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @staticmethod
    def decode(raw: bytes) -> NextGeneration:
        try:
            d = json.loads(raw)
            return NextGeneration(
                gen=int(d["gen"]),
                port=int(d["port"]),
                replaced=tuple(int(r) for r in d["replaced"]),
                cause=d["cause"],
                fallback=d.get("fallback"),
                time=float(d.get("time", 0.0)),
            )
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(
                f"in-place protocol: the agent's word is not a NextGeneration ({raw[:200]!r}): "
                "the agent and the ranks run different versions of orchestrator"
            ) from e


def next_key(gen: int) -> str:
    """The control-store key the agent writes once generation ``gen`` broke."""
    return f"orchestrator/inplace/next/{gen}"


def refused_key(gen: int, rank: int) -> str:
    """Where a survivor of broken generation ``gen`` says why it cannot re-form in place
    before it gives up (its engine, an open incident, a failed heal): the agent's fallback
    then journals that reason instead of only the survivor's death."""
    return f"orchestrator/inplace/refused/{gen}/{rank}"


def joined_key(gen: int) -> str:
    """The counter every rank of generation ``gen`` adds 1 to once formed and healed."""
    return f"orchestrator/inplace/joined/{gen}"
