"""The node agent's side of an in-place recovery (docs/dev/issue-33-design.md 3.2-3.3): a
rank that died is started again alone in the next generation, on a fresh group store, and
the agent waits until every rank of that generation has joined; when it cannot (policy off,
several nodes, a deliberate exit, more ranks dead than alive, a second death while healing,
the join timing out) it writes the fallback word and the caller stops every rank, so the
supervisor restarts the attempt as before.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from collections.abc import Callable

from torch.distributed import TCPStore

from orchestrator import inplace_protocol as IP
from orchestrator.agent_ranks import Rank, Ranks
from orchestrator.events.supervisor import Hang
from orchestrator.heartbeat import forget_beat
from orchestrator.journal import Journal, read_events
from orchestrator.policy_sections import SupervisorPolicy
from orchestrator.protocol import (
    ENV_ATTEMPT,
    ENV_RUN_DIR,
    EXIT_GAVE_UP,
    EXIT_PREEMPTED,
    EXIT_UNHEALTHY,
)

logger = logging.getLogger("orchestrator.agent")
DELIBERATE = {EXIT_GAVE_UP, EXIT_UNHEALTHY, EXIT_PREEMPTED}  # the Guard chose to end: no heal
EVENT_RANK_REPLACED = "rank_replaced"
EVENT_INPLACE_FAILED = "inplace_failed"
STOPPING = "the agent is stopping (a signal came)"
REQUEST = "orchestrator/agent/request/{}"  # another node's agent asks node 0's for a store


def _journal() -> Journal | None:
    run_dir = os.environ.get(ENV_RUN_DIR)
    if not run_dir:  # run without the supervisor: nothing to journal into
        return None
    return Journal(run_dir, rank=-1, attempt=int(os.environ.get(ENV_ATTEMPT, "0")))


class Healer:
    """Replaces dead ranks in place, or says it cannot."""

    def __init__(
        self,
        ranks: Ranks,
        control: TCPStore,
        addr: str,
        enabled: bool,
        sup: SupervisorPolicy,
    ) -> None:
        self.ranks, self.control, self.addr = ranks, control, addr
        self.host = ranks.layout.group_rank == 0  # node 0's agent hosts the stores
        self.enabled, self.timeout_s = enabled, sup.in_place_timeout_s
        self.max_heals = sup.in_place_max_per_attempt
        self.gen = 0
        self.stores: list[TCPStore] = []  # the current generation's group store (kept alive)
        self.journal = _journal() if enabled else None
        self.run_dir = os.environ.get(ENV_RUN_DIR, "")

    def close(self) -> None:
        if self.journal is not None:
            self.journal.close()

    def sync(self) -> str | None:
        """Follow the generations other nodes' agents started; on node 0, serve their
        requests for a group store. The fallback reason, once one was written."""
        if not self.enabled:
            return None
        while (word := self._word(self.gen)) is not None:
            if word.fallback is not None:
                return word.fallback
            self.gen = word.gen
        key = REQUEST.format(self.gen)
        if self.host and self.control.check([key]):
            req = json.loads(self.control.get(key))
            self._announce(self.gen, tuple(req["replaced"]), req["cause"])
        return None

    def heal(self, dead: list[Rank], stopping: Callable[[], bool]) -> bool:
        """Replace ``dead`` (this node's ranks of the current generation); False: fall
        back (the fallback word is written)."""
        world = self.ranks.layout.world_size
        codes = [r.proc.returncode for r in dead]
        cause: IP.Cause = "signal" if any(c < 0 for c in codes) else "exit"
        if all(c == -signal.SIGKILL for c in codes) and self._hung(dead):
            cause = "hang"  # the supervisor's hang watch killed them (launch/runner.py)
        if self.sync() is not None:
            return False  # another node's agent fell back already
        why = self._refuse(dead, codes, world)
        if why is None and stopping():
            why = STOPPING
        if why is None and self.gen > 0 and self._joined(self.gen) < world:
            why = f"rank(s) died while generation {self.gen} was healing"
        if why is not None:
            self._fallback(self.gen, dead, cause, why)
            return False
        g, replaced, decided = self.gen, tuple(r.rank for r in dead), time.time()
        if self.host:
            word: IP.NextGeneration | None = self._announce(g, replaced, cause)
        else:  # node 0's agent hosts the stores: ask it for the next generation's
            word = self._request(g, replaced, cause, stopping)
        if word is None or word.fallback is not None or set(word.replaced) != set(replaced):
            self._fallback(g, dead, cause, f"no next generation for rank(s) {list(replaced)}")
            return False
        for r in dead if self.run_dir else ():
            forget_beat(self.run_dir, r.rank)
        new = [self.ranks.replace(r.local, (self.addr, word.port), word.gen) for r in dead]
        logger.warning(
            "agent: rank(s) %s died (%s); replaced alone in generation %d",
            list(replaced), codes, word.gen,
        )  # fmt: skip
        why = self._wait_joined(word.gen, world, stopping, broken=g)
        if why is not None:
            self._fallback(word.gen, dead, cause, why)
            return False
        self.gen, joined = word.gen, time.time()
        for old, rep, code in zip(dead, new, codes, strict=True):
            self._write(word.gen, EVENT_RANK_REPLACED, {
                "rank": old.rank, "cause": cause, "generation": word.gen, "returncode": code,
                "pid_old": old.proc.pid, "pid_new": rep.proc.pid, "spare": rep.spare,
                "decided": decided, "joined": joined, "seconds": round(joined - decided, 3),
            })  # fmt: skip
        return True

    def _word(self, g: int) -> IP.NextGeneration | None:
        key = IP.next_key(g)
        return (
            IP.NextGeneration.decode(self.control.get(key)) if self.control.check([key]) else None
        )

    def _joined(self, g: int) -> int:
        return int(self.control.add(IP.joined_key(g), 0))

    def _announce(self, g: int, replaced: tuple[int, ...], cause: IP.Cause) -> IP.NextGeneration:
        """Node 0: a fresh group store for ``g + 1`` and the word on ``next_key(g)``; the
        first word written wins (two nodes may ask at once): the word now there."""
        group = TCPStore(self.addr, 0, is_master=True, wait_for_workers=False)
        word = IP.NextGeneration(g + 1, group.port, replaced, cause, None, time.time())
        won = IP.NextGeneration.decode(
            self.control.compare_set(IP.next_key(g), "", word.encode().decode())  # JSON: ASCII
        )
        if won == word:
            self.stores.append(group)  # lives as long as the agent: its ranks' store
        return won

    def _request(
        self, g: int, replaced: tuple[int, ...], cause: IP.Cause, stopping: Callable[[], bool]
    ) -> IP.NextGeneration | None:
        """Another node: ask node 0's agent for generation ``g + 1``; its word, or None."""
        ask = json.dumps({"replaced": list(replaced), "cause": cause})
        self.control.compare_set(REQUEST.format(g), "", ask)
        deadline = time.monotonic() + self.timeout_s
        while (word := self._word(g)) is None:
            if stopping() or time.monotonic() >= deadline:
                return None
            time.sleep(0.02)
        return word

    def _refuse(self, dead: list[Rank], codes: list[int], world: int) -> str | None:
        """Why in place cannot be tried for ``dead``, or None."""
        if not self.enabled:
            return "in place is off (supervisor.in_place)"
        deliberate = [c for c in codes if c in DELIBERATE]
        if deliberate:
            return f"a rank ended on purpose (exit {deliberate[0]})"
        if 2 * len(dead) > world:
            return f"{len(dead)} of {world} ranks died: more than survive"
        if self.gen >= self.max_heals:
            return (
                f"{self.gen} in-place recoveries in this attempt already "
                "(supervisor.in_place_max_per_attempt)"
            )
        return None

    def _wait_joined(
        self, g: int, world: int, stopping: Callable[[], bool], broken: int
    ) -> str | None:
        """Wait until ``world`` ranks joined generation ``g``; why not, or None. A survivor
        of generation ``broken`` that says it cannot re-form ends the wait at once."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            if self._joined(g) >= world:
                return None
            said = self._refusals(broken)
            if said:
                return f"a survivor cannot re-form in place{said}"
            word = self._word(g)
            if word is not None and word.fallback is not None:
                return word.fallback
            died = [r.rank for r in self.ranks.ranks if r.poll() not in (None, 0)]
            if died:
                return f"rank(s) {died} died while generation {g} was healing" + (
                    self._refusals(broken)
                )
            if stopping():
                return STOPPING
            if time.monotonic() >= deadline:
                return (
                    f"generation {g} did not form within supervisor.in_place_timeout_s="
                    f"{self.timeout_s:g} s (a survivor without the in-place side, or stuck)"
                )
            time.sleep(0.02)

    def _refusals(self, g: int) -> str:
        """What this node's survivors of broken generation ``g`` said before giving up (a
        survivor on another node is its own agent's to report), or ''."""
        said = []
        for rank in (r.rank for r in self.ranks.ranks):
            key = IP.refused_key(g, rank)
            try:
                if self.control.check([key]):
                    said.append(f"rank {rank}: {self.control.get(key).decode()}")
            except (RuntimeError, UnicodeDecodeError):  # the store's host is gone: say less
                break
        return f" ({'; '.join(said)})" if said else ""

    def _fallback(self, gen: int, dead: list[Rank], cause: IP.Cause, why: str) -> None:
        """Say so to the ranks (they leave) and the other agents; the caller stops them.
        Written on the newest generation's key: a word already there is not overwritten."""
        logger.warning("agent: no in-place recovery (%s): every rank is stopped", why)
        if why != STOPPING:  # a preemption is no failure of in place
            details = {"reason": why, "ranks": [r.rank for r in dead], "cause": cause}
            self._write(gen, EVENT_INPLACE_FAILED, {**details, "generation": gen})
        word = IP.NextGeneration(0, 0, tuple(r.rank for r in dead), cause, why, time.time())
        try:
            while True:
                now = IP.NextGeneration.decode(
                    self.control.compare_set(IP.next_key(gen), "", word.encode().decode())
                )
                if now.fallback is not None:
                    return
                gen = now.gen  # a generation formed meanwhile: its members must leave
        except Exception:  # the store's host (node 0's agent) is gone: the ranks fail anyway
            logger.exception("agent: could not write the fallback word")

    def _hung(self, dead: list[Rank]) -> bool:
        """Whether the supervisor's ``hang`` event of this attempt named every rank of
        ``dead`` as a culprit after they started (it kills a hang's culprits alone)."""
        if self.journal is None:
            return False
        since = min(r.started for r in dead)
        named: set[int] = set()
        for e in read_events(self.run_dir).of(Hang):
            if e.attempt == self.journal.attempt and e.time >= since:
                named |= {int(c["rank"]) for c in e.record.culprits or []}
        return {r.rank for r in dead} <= named

    def _write(self, g: int, kind: str, details: dict[str, object]) -> None:
        if self.journal is not None:
            self.journal.write(kind, -1, details)
