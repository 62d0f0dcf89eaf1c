"""The faults of the parts around the step: durable storage (``storage_error``,
``slow_storage``, ``kill_persist``, ``truncate_snapshot``, ``corrupt_manifest``), the
health check (``miss_health``, ``corrupt_allreduce``, ``flaky_compute``, ``slow_rank``)
and shared memory (``corrupt_shm``). Each wraps the component's own methods (instance
attributes that shadow them) at the point where the fault used to be called inline.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch

from orchestrator.faults.injector import FaultInjector
from orchestrator.health import _PATTERN, HealthChecker
from orchestrator.shm import ShmSlots
from orchestrator.snapshot import Snapshot
from orchestrator.store import DurableStore

if TYPE_CHECKING:
    from orchestrator.durable import DurableTier


def wrap_durable(durable: DurableTier, injector: FaultInjector) -> None:
    """The remote store's writes and reads, and both tiers' reads on resume, go through
    the storage faults; ``kill_persist`` watches the phases of a remote write; the faults
    that damage a committed snapshot act right after its commit, before it is journaled."""
    remote = durable.store
    remote._hook = injector.persist_phase
    _storage(remote, injector, writes=True)
    if durable.local is not None:
        _storage(durable.local.store, injector, writes=False)
    persister = durable.persister
    if persister is None:
        return
    after = persister._after_commit

    def after_commit(
        snap: Snapshot, manifest: dict[str, Any], nbytes: int, written: float, t0: float
    ) -> None:
        if injector.truncate_due(snap.step):
            injector.truncate(remote, snap.step)
        how = injector.corrupt_manifest_due(snap.step)
        if how is not None:
            injector.corrupt_manifest(remote, snap.step, how)
        after(snap, manifest, nbytes, written, t0)

    setattr(persister, "_after_commit", after_commit)  # noqa: B010 (a method, shadowed)


def _storage(store: DurableStore, injector: FaultInjector, writes: bool) -> None:
    """Each try (retries included) of writing a part or of reading a snapshot
    back first meets ``slow_storage`` and ``storage_error`` (``writes``: the writes too)."""
    validate = store.validate_files

    def validate_files(step: int, manifest: dict[str, Any], ranks: list[int]) -> None:
        injector.storage("read", step)
        validate(step, manifest, ranks)

    setattr(store, "validate_files", validate_files)  # noqa: B010 (a method, shadowed)
    if not writes:
        return
    write_part = store.write_part

    def write_part_(snap: Snapshot, *args: Any, **kwargs: Any) -> int:
        injector.storage("write", snap.step)
        return write_part(snap, *args, **kwargs)

    setattr(store, "write_part", write_part_)  # noqa: B010


def wrap_health(checker: HealthChecker, injector: FaultInjector) -> None:
    """``miss_health``: this rank never enters a check, or freezes right after its roll
    call; ``corrupt_allreduce``: one wrong value in its contributions; ``flaky_compute``:
    one wrong element in its self-test's product; ``slow_rank``: each timed repetition of
    the bandwidth check after the first takes ``factor`` times as long."""
    run, call, mine, product = checker.run, checker._call, checker._mine, checker._product

    def run_(reason: str) -> Any:
        injector.miss_health()
        return run(reason)

    def call_(key: str, value: str) -> None:
        call(key, value)
        if key == f"{checker._round}/{checker.comm.rank}":  # the roll call
            injector.miss_health(entered=True)

    def mine_() -> torch.Tensor:
        t = mine()
        t[_PATTERN // 2] += 1.0  # one wrong value, as a flipped bit would make
        return t

    def product_(a: torch.Tensor) -> torch.Tensor:
        c = product(a)
        n = a.shape[0]
        c[n // 2, n // 3] += 1.0
        return c

    def pace(times: list[float]) -> None:
        if times:
            time.sleep((injector.slow_factor - 1.0) * times[-1])  # a slow rank/link

    setattr(checker, "run", run_)  # noqa: B010 (methods, shadowed)
    setattr(checker, "_call", call_)  # noqa: B010
    if injector.corrupt_collectives:
        setattr(checker, "_mine", mine_)  # noqa: B010
    if injector.flaky_compute:
        setattr(checker, "_product", product_)  # noqa: B010
    if injector.slow_factor > 1.0:
        setattr(checker, "_pace", pace)  # noqa: B010


def corrupt_slot(shm: ShmSlots, snap: Snapshot | None) -> None:
    """The ``corrupt_shm`` fault: flip bytes in the middle of this rank's part of
    ``snap``'s slot (its largest share of the node part, else its own file) after its
    verdict is written (the in-process ring shares them: a test fault, not a drill)."""
    shm.join()
    if snap is None:
        return
    mapped, at, n = shm._maps[snap.slot], 0, 0
    share = shm._share[snap.slot]
    node = shm._node_maps[snap.slot]
    if node is not None and share:
        mapped, (at, n) = node, max(share, key=lambda s: s[1])
    elif mapped is not None:
        # The middle of its largest tensor: the file has room beyond the tensors (made at
        # the first capture for a state that grows), where a flip would change nothing.
        base, end = mapped.data_ptr(), mapped.data_ptr() + mapped.numel()
        inside = [b for b in snap.buffers if base <= b.data_ptr() < end]
        if inside:
            big = max(inside, key=lambda b: b.numel() * b.element_size())
            at, n = big.data_ptr() - base, big.numel() * big.element_size()
    if mapped is not None and n >= 8:
        mid = at + n // 2 - 4
        mapped[mid : mid + 8] ^= 0xFF
