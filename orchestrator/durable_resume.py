"""The durable tier's resume on start (orchestrator/durable.py): the newest snapshot valid
on every rank, from the node's shared-memory ring, the node-local tier or the durable store,
agreed by every rank (collective), or why none can be used.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from orchestrator.comm import Comm
from orchestrator.engines import Engine
from orchestrator.errors import PersistError
from orchestrator.policy_sections import PersistPolicy
from orchestrator.retry import is_transient, storage_retry
from orchestrator.shm import ShmSlots, agreeable
from orchestrator.store import SNAPSHOT_ERRORS, DurableStore
from orchestrator.writer import LocalTier

#: A state tree to restore, the manifest it came with, and the store URL it came from.
Resumable = tuple[dict[str, Any], dict[str, Any], str]


class ResumeFinder:
    """The resume of :class:`orchestrator.durable.DurableTier` (its state, declared here)."""

    policy: PersistPolicy
    comm: Comm
    engine: Engine
    store: DurableStore
    local: LocalTier | None
    shm: ShmSlots | None
    refused: list[str]
    event: Callable[..., None]  # journals a collective decision once (rank 0)

    def find_resume(self) -> Resumable | None:
        """The newest snapshot valid on every rank (collective), or None if there is none.

        Raises:
            PersistError: committed snapshots exist but none is valid (starting from
                scratch silently could throw away days of training).
        """
        listing = self._listing()
        newest_remote = listing[0][0] if listing else -1
        in_shm = self._find_shm(newest_remote)
        if in_shm is not None:
            return in_shm
        local = self._find_local(newest_remote)
        if local is not None:
            return local
        rejected: list[tuple[int, list[str]]] = []
        for step, manifest, problem in listing:
            tree, error, transient = self._load(self.store, step, manifest, problem, 0)
            said = self.comm.all_gather_object((error, transient))
            errors = [e for e, _ in said if e]
            unreadable = [e for e, t in said if t]
            if unreadable:  # not invalid: unreadable now (a restart retries)
                raise self._unreachable(unreadable[0])
            if errors:
                rejected.append((step, errors))
                self.event("snapshot_invalid", snapshot_step=step, reasons=errors)
                continue
            assert tree is not None and manifest is not None
            return tree, manifest, self.store.url
        if not rejected and self.refused:
            # Slots were left in the node's shared memory (a crash of this job) and none
            # could be used: starting from scratch would silently throw that work away.
            raise PersistError(
                f"the node's shared-memory ring holds snapshots of this run but none can be "
                f"used ({len(self.refused)} refused; first: {self.refused[0]}) and there is no "
                f"durable snapshot under {self.store.url}. To start over anyway use "
                "`orchestrator launch --fresh` or persist.resume: false; to resume, start on "
                "the same nodes at the same world size"
            )
        if rejected:
            raise PersistError(
                f"{len(rejected)} committed snapshot(s) under {self.store.url}, none valid "
                f"(steps {[s for s, _ in rejected]}; first reason: {rejected[0][1][0]}). "
                "To start from scratch anyway set persist.resume: false or use another "
                "persist.url; to keep them, check the storage and run "
                f"`orchestrator snapshots {self.store.url}`"
            )
        return None

    def _listing(self) -> list[tuple[int, dict[str, Any] | None, str | None]]:
        """The committed snapshots of the durable store, newest first, as rank 0 lists them
        (step, manifest, why it is unreadable), on every rank (collective).

        Raises:
            PersistError: the store cannot be listed (journaled: ``storage_unreachable``).
        """
        listing, unreachable = None, None
        if self.comm.rank == 0:
            try:
                listing = [
                    (c.step, c.manifest, c.problem)
                    for c in storage_retry(self.policy)(self.store.candidates)
                    if c.committed
                ]
            except Exception as err:
                unreachable = f"cannot list {self.store.url}: {err!r}"
        listing, unreachable = self.comm.broadcast_object((listing, unreachable))
        if unreachable is not None:
            raise self._unreachable(unreachable)
        assert listing is not None
        return listing

    def _unreachable(self, why: str) -> PersistError:
        """Journal (``storage_unreachable``) and return the error that stops the start."""
        self.event("storage_unreachable", error=why, url=self.store.url)
        return PersistError(
            f"the durable store cannot be read ({why}; transient errors retried up to "
            f"persist.retries={self.policy.retries} times): not resuming from an older "
            "snapshot nor from scratch, which could lose training. Under `orchestrator "
            "launch` the next attempt tries again; otherwise run the same command once the "
            "storage is back (or fix its permissions)"
        )

    def _find_shm(self, newest_remote: int) -> Resumable | None:
        """The node's shared-memory ring: the newest step every rank has sealed there whose
        bytes match their checksum on every rank, if not older than the newest durable
        snapshot. Refused slots are said in ``self.refused`` (the resume event shows it)."""
        if self.shm is None:
            return None
        steps, refused = self.shm.candidates()
        seen = self.comm.all_gather_object(({s: t for s, (_, t) in steps.items()}, refused))
        order, self.refused = agreeable(seen, newest_remote)  # alike on every rank
        for step in order:
            why = self.shm.check(steps[step][0])
            tree = None
            if why is None:
                try:
                    tree = self.shm.load(steps[step][0])
                except Exception as err:  # never raises before the agreement
                    why = f"step {step}: {err}"
            errors = [f"rank {r}: {e}" for r, e in enumerate(self.comm.all_gather_object(why)) if e]
            if errors:
                self.refused += errors
                continue
            assert tree is not None
            return tree, {"world_size": self.comm.world_size}, f"shm://{self.shm.root}"
        return None

    def _find_local(self, newest_remote: int) -> Resumable | None:
        """The node-local tier, if every rank has the same valid step there and it is not
        older than the newest remote snapshot."""
        if self.local is None:
            return None
        found: tuple[int, dict[str, Any]] | None = None
        for c in self.local.store.candidates():
            if c.committed and c.manifest is not None:
                found = (c.step, c.manifest)
                break
        tree = None
        if found is not None and found[0] >= newest_remote:
            tree, _, _ = self._load(self.local.store, *found, None, self.local.leader)
        steps = self.comm.all_gather_object(found[0] if tree is not None and found else None)
        if steps[0] is None or any(s != steps[0] for s in steps):
            return None
        assert tree is not None and found is not None
        return tree, found[1], self.local.store.url

    def _load(
        self,
        store: DurableStore,
        step: int,
        manifest: dict[str, Any] | None,
        problem: str | None,
        shared_rank: int,
    ) -> tuple[dict[str, Any] | None, str | None, bool]:
        """This rank's state from one snapshot (the shared state from ``shared_rank``'s
        part), or why it cannot be used and whether that may pass (storage unreachable, not
        the snapshot invalid). Never raises, so every rank reaches the agreement that
        follows."""
        rank = self.comm.rank
        try:
            if manifest is None:
                raise PersistError(problem or f"snapshot {step}: manifest.json is unreadable")
            saved = manifest.get("ranks") or list(range(int(manifest["world_size"])))
            own = rank if rank in saved else shared_rank  # a new rank takes the shared RNG
            sharded = not self.engine.state_replicated
            if sharded and int(manifest["world_size"]) != self.comm.world_size:
                if not self.engine.can_reshard:
                    raise PersistError(
                        f"snapshot {step} holds shards of {manifest['world_size']} ranks and "
                        f"{self.engine.name} cannot reshard: resume at that world size"
                    )

                def reshard() -> dict[str, Any]:
                    store.validate_files(step, manifest, saved)
                    parts = [store.load_part(step, r) for r in saved]
                    return self.engine.reshard(parts, saved.index(own))

                return storage_retry(self.policy)(reshard), None, False

            # Sharded state: each rank reads its own part only.
            first = own if sharded else shared_rank

            def read() -> dict[str, Any]:
                store.validate_files(step, manifest, sorted({first, own}))
                tree = store.load_part(step, first)
                if own != first:
                    tree.update(store.load_part(step, own))
                return tree

            return storage_retry(self.policy)(read), None, False
        except SNAPSHOT_ERRORS as err:  # anything wrong with this snapshot: try an older one
            return None, f"rank {rank}: {err}", is_transient(err)

    def tier_of(self, url: str) -> str:
        if url.startswith("shm://"):
            return "shm"
        return "local" if self.local is not None and url == self.local.store.url else "remote"
