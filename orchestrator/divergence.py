"""Recovery's replica divergence: naming the rank(s) whose state the other replicas did
not hold (by majority, or once the replay settles a tie) and stopping on a sick one."""

from __future__ import annotations

import socket

import torch

from orchestrator import replicas
from orchestrator.comm import Comm
from orchestrator.engines import Engine
from orchestrator.errors import Unhealthy
from orchestrator.journal import Decisions
from orchestrator.logs import RankLogger
from orchestrator.protocol import EVENT_UNHEALTHY


class Divergence:
    """Part of :class:`orchestrator.recovery.Recovery` (its divergence culprits); uses the
    attributes declared here, which Recovery sets."""

    comm: Comm
    engine: Engine
    decide: Decisions
    log: RankLogger
    culprits: replicas.Culprits
    _host_names: list[str] | None

    def replicas_agreed(self, step: int, value: int) -> None:
        """The replicas agreed on ``value`` at ``step``: if a tied divergence was waiting for
        the replay to reach that step, the ranks whose digest was not ``value`` held what
        no exact replay reproduces: they are named."""
        tie = self.culprits.pending.pop(step, None)
        if tie is None:
            return
        ranks = [r for r, d in enumerate(tie.digests) if d != value]
        by, distances = "replay", None  # distances: only when no rank held it exactly
        if len(ranks) == self.comm.world_size:  # no rank held the replayed state exactly
            here = replicas.sketch(self.engine.digest_tensors()[0])
            mine = float(torch.linalg.vector_norm(tie.sketch - here))
            distances = self.comm.all_gather_object(mine)
            assert distances is not None
            ranks, by = replicas.farthest(distances), "distance"
            if not ranks:
                self.decide("divergence_unresolved", step, digest=value, distances=distances)
                return
        self._name_culprits(step, ranks, by, distances)

    def _name_culprits(
        self, step: int, ranks: list[int], by: str, distances: list[float] | None = None
    ) -> None:
        """Journal the odd rank(s) out with their hosts; a rank named ``sick_after`` times
        is sick: stop with exit code 72 so the node can be excluded."""
        hosts = self._hosts()
        named = {str(r): hosts[r] for r in ranks}
        extra = {"distances": distances} if distances is not None else {}
        self.decide("divergence_culprit", step, ranks=ranks, hosts=named, by=by, **extra)
        sick = self.culprits.name(step, ranks)
        if not sick:
            return
        where = {str(r): hosts[r] for r in sick}
        self.decide(
            EVENT_UNHEALTHY, step, reason="divergence", ranks=sick,
            hosts=sorted(set(where.values())), failed={r: ["replica_digest"] for r in where},
        )  # fmt: skip
        if self.comm.rank == 0:
            self.log.error(
                "UNHEALTHY: rank(s) %s (%s) held state the other replicas did not, %d times "
                "within %d steps (detect.replicas.sick_after). Exclude these nodes and restart.",
                sick, where, self.culprits.sick_after, self.culprits.window_steps,
            )  # fmt: skip
        raise Unhealthy(f"replica divergence: ranks {sick} on {sorted(set(where.values()))}")

    def _hosts(self) -> list[str]:
        if self._host_names is None:
            self._host_names = self.comm.all_gather_object(socket.gethostname())
        return self._host_names
