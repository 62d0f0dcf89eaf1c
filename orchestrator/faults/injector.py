"""What each fault does, and when it fires (policy ``faults``; empty by default). Where it
acts is in :mod:`orchestrator.faults.step` and :mod:`orchestrator.faults.parts`.

A poisoned sample makes the loss of every batch holding it non-finite, every time it is
seen. Every other fault fires once per run directory: firing is journaled (``fault``) by the
rank it fires on, and a Guard starting in the same run directory reads those events back, so
a replay after a rollback or a restart does not fire it again. ``storage_error`` counts its
``times`` per rank and per process.

The injector is shared by the training thread and the persist thread, hence the lock.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch

from orchestrator.faults.model import install_nan_module
from orchestrator.journal import Journal, read_journal
from orchestrator.protocol import ENV_SUPERVISOR_PID
from orchestrator.store import step_dir

if TYPE_CHECKING:
    from orchestrator.store import DurableStore

from orchestrator.fault_kinds import (
    BrokenGradsFault,
    CorruptAllreduceFault,
    CorruptManifestFault,
    CorruptShmFault,
    CrashFault,
    CrashSampleFault,
    ExitFault,
    Fault,
    FlakyComputeFault,
    HangFault,
    InfLossFault,
    KillPersistFault,
    LrBlowupFault,
    MissHealthFault,
    NanGradFault,
    NanModuleFault,
    OutlierSampleFault,
    PerturbParamsFault,
    PoisonSampleFault,
    PreemptFault,
    SlowRankFault,
    SlowStorageFault,
    StorageErrorFault,
    TruncateSnapshotFault,
)


def fault_key(f: Fault) -> str:
    """A fault's identity in the journal: one that fired does not fire again when the run
    resumes (and a rolled-back step is not the same fault twice)."""
    fields = f.model_dump(exclude={"kind"}, exclude_none=True)
    return f.kind + ":" + ",".join(f"{k}={v}" for k, v in sorted(fields.items()))


def _fired(run_dir: str, rank: int) -> set[Any]:
    """The keys of the faults that already fired on ``rank`` in ``run_dir`` (its journal's
    ``fault`` events): those do not fire again."""
    return {
        e["details"].get("key")
        for e in read_journal(run_dir)
        if e.get("kind") == "fault" and e.get("rank") == rank
    }


def _pending(faults: list[Fault], rank: int, attempt: int, fired: set[Any]) -> list[Fault]:
    """The once-per-run faults not yet ``fired`` that are ``rank``'s to fire: the training
    faults of this rank (and of this ``attempt`` when they name one), the durable snapshot's
    on rank 0 (it commits the snapshot), and the persist thread's and health check's of
    this rank."""
    once = (
        NanGradFault,
        InfLossFault,
        CrashFault,
        HangFault,
        ExitFault,
        PreemptFault,
        CorruptShmFault,
        PerturbParamsFault,
        LrBlowupFault,
    )
    pending: list[Fault] = [
        f
        for f in faults
        if isinstance(f, once)
        and f.rank == rank
        and f.attempt in (None, attempt)
        and fault_key(f) not in fired
    ]
    pending += [
        f
        for f in faults
        if isinstance(f, (TruncateSnapshotFault, CorruptManifestFault))
        and rank == 0
        and fault_key(f) not in fired
    ]
    pending += [
        f
        for f in faults
        if isinstance(f, (KillPersistFault, MissHealthFault))
        and f.rank == rank
        and fault_key(f) not in fired
    ]
    return pending


class InjectedStorageError(OSError):
    """A storage failure injected by the ``storage_error`` fault."""


class FaultInjector:
    def __init__(self, faults: list[Fault], rank: int, run_dir: str, journal: Journal) -> None:
        self.rank = rank
        self.journal = journal
        self._lock = threading.Lock()
        fired = _fired(run_dir, rank)
        self._pending = _pending(faults, rank, journal.attempt, fired)
        self._perturbs = any(isinstance(f, PerturbParamsFault) for f in self._pending)
        self._nan_modules = [
            f
            for f in faults
            if isinstance(f, NanModuleFault)
            and f.rank in (None, rank)
            and fault_key(f) not in fired
        ]
        self._nan_fired: list[NanModuleFault] = []
        self._storage = {
            i: f.times
            for i, f in enumerate(faults)
            if isinstance(f, StorageErrorFault) and f.rank in (None, rank)
        }
        self._storage_faults = self._all = faults
        self._hooks: list[Any] = []
        self._slow = [
            f for f in faults if isinstance(f, SlowStorageFault) and f.rank in (None, rank)
        ]
        self.poisoned = frozenset(f.sample for f in faults if isinstance(f, PoisonSampleFault))
        self.outliers = {f.sample: f.extra for f in faults if isinstance(f, OutlierSampleFault)}
        self.killers = {f.sample: f.how for f in faults if isinstance(f, CrashSampleFault)}
        self._broken = min(
            (f.step for f in faults if isinstance(f, BrokenGradsFault) and f.rank == rank),
            default=None,
        )
        self._blowups = any(isinstance(f, LrBlowupFault) for f in self._pending)
        self._blowup: tuple[int, int, float] | None = None  # (from, to, factor) while it lasts
        self._last_step = -1
        # Health-check faults hold for the whole run on their rank.
        mine = [f for f in faults if getattr(f, "rank", None) == rank]
        self.corrupt_collectives = any(isinstance(f, CorruptAllreduceFault) for f in mine)
        self.flaky_compute = any(isinstance(f, FlakyComputeFault) for f in mine)
        self.slow_factor = max(
            (f.factor for f in mine if isinstance(f, SlowRankFault)), default=1.0
        )

    def _take(self, cls: type, step: int, at_or_after: bool = False, micro: int = 0) -> bool:
        """Take the pending ``cls`` fault of ``step`` (or of an earlier one)."""

        def due(f: Fault) -> bool:
            fstep = getattr(f, "step", None)
            hit = fstep is not None and (step >= fstep if at_or_after else step == fstep)
            return isinstance(f, cls) and hit and getattr(f, "micro", micro) == micro

        return self._take_first(due, step) is not None

    def on_loss(
        self,
        loss: torch.Tensor,
        step: int,
        sample_ids: Iterable[int],
        one_shot: bool,
        micro: int = 0,
    ) -> torch.Tensor:
        """The loss as the faults make it: NaN for a poisoned sample, plus inf for an
        ``inf_loss`` fault (``one_shot=False`` during re-runs: only the poison applies); a
        ``crash_sample`` kills the process here, in the loop body."""
        if self.killers:
            self._kill_for(sample_ids)
        if self.poisoned and not self.poisoned.isdisjoint(sample_ids):
            return loss * float("nan")
        if self.outliers:
            ids = list(sample_ids)
            extra = sum(self.outliers.get(i, 0.0) for i in ids)
            if extra:
                return loss + extra / max(len(ids), 1)
        if one_shot and self._take(InfLossFault, step, micro=micro):
            return loss + float("inf")
        return loss

    def install_module_faults(
        self, core: torch.nn.Module, step: Callable[[], int], rerun_of: Callable[[], int | None]
    ) -> None:
        """Hooks for this rank's ``nan_module`` faults; ``step`` and ``rerun_of`` (the step
        under investigation, if any) are read when the module runs."""
        mine = [
            f for f in self._all if isinstance(f, NanModuleFault) and f.rank in (None, self.rank)
        ]
        for f in mine:
            armed = functools.partial(self._nan_armed, f, step, rerun_of)
            self._hooks.append(install_nan_module(core, f.module, armed))

    def _nan_armed(
        self, f: NanModuleFault, step: Callable[[], int], rerun_of: Callable[[], int | None]
    ) -> bool:
        return self.nan_module_armed(f, step(), rerun_of())

    def nan_module_armed(self, f: NanModuleFault, step: int, rerun_of: int | None) -> bool:
        """Whether fault ``f`` turns its module's output NaN now: once, on the real pass of
        its step, and again in every re-run of the incident that pass caused."""
        if rerun_of is not None:
            return f in self._nan_fired and f.step == rerun_of
        with self._lock:
            if f in self._nan_modules and f.step == step:
                self._nan_modules.remove(f)
                self._nan_fired.append(f)
                self.journal.write("fault", step, {"key": fault_key(f), "fault": f.model_dump()})
                return True
        return False

    def _kill_for(self, sample_ids: Iterable[int]) -> None:
        for i in sample_ids:
            how = self.killers.get(i)
            if how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if how == "raise":
                raise IndexError(f"index out of range in self (crash_sample fault: sample {i})")

    def grad_fault(self, step: int, micro: int = 0) -> bool:
        """True when a NaN must be written into a gradient of this micro-batch."""
        if self._broken is not None and step >= self._broken:
            return True
        return self._take(NanGradFault, step, micro=micro)

    def process_faults(self, step: int, settle: Callable[[], object] = lambda: None) -> None:
        """``crash``: die the way an OOM kill or a segfault does (SIGKILL, no cleanup; with
        ``after_persist``, once ``settle()`` returned: the durable writes in flight are done).
        ``exit``: exit at once with the fault's code. ``hang``: block forever inside the
        step, as a rank stuck in a dead collective does. ``preempt``: SIGTERM to the
        supervisor (or to this process without one)."""
        crash = next(
            (f for f in self._pending if isinstance(f, CrashFault) and f.step == step), None
        )
        if crash is not None:
            if crash.after_persist:
                settle()  # before the fault is journaled: a watcher sees it after the writes
            if self._take(CrashFault, step):
                os.kill(os.getpid(), signal.SIGKILL)
        for f in list(self._pending):
            if isinstance(f, ExitFault) and f.step == step and self._take(ExitFault, step):
                os._exit(f.code)
        if self._take(PreemptFault, step):
            supervisor = os.environ.get(ENV_SUPERVISOR_PID)
            os.kill(int(supervisor) if supervisor else os.getpid(), signal.SIGTERM)
        if self._take(HangFault, step):
            while True:
                time.sleep(3600)

    def perturb_params(self, step: int, core: torch.nn.Module) -> None:
        """``perturb_params``: this rank's parameters drift at ``step`` (local shards)."""
        if not self._perturbs:  # the healthy step runs nothing more of it
            return
        f = self._take_first(lambda f: isinstance(f, PerturbParamsFault) and f.step == step, step)
        if f is None:
            return
        assert isinstance(f, PerturbParamsFault)
        with torch.no_grad():
            for p in core.parameters():
                local = p.to_local() if hasattr(p, "to_local") else p
                local.add_(f.by)

    def lr_factor(self, step: int) -> float:
        """``lr_blowup``: the factor on this step's LR (1.0 when none lasts now); a rollback
        (a step not after the last one asked about) ends it."""
        if not self._blowups:  # the healthy step runs nothing more of it
            return 1.0
        if step <= self._last_step:
            self._blowup = None
        self._last_step = step
        f = self._take_first(lambda f: isinstance(f, LrBlowupFault) and f.step == step, step)
        if isinstance(f, LrBlowupFault):
            self._blowup = (step, step + f.steps, f.factor)
        if self._blowup is not None and self._blowup[0] <= step < self._blowup[1]:
            return self._blowup[2]
        return 1.0

    def corrupt_shm_due(self, step: int) -> bool:
        return self._take(CorruptShmFault, step)

    def storage(self, op: str, step: int) -> None:
        """Delay ``op`` (slow_storage), or raise an injected storage error for it while the
        fault has some left (storage_error). Called from the writer thread."""
        self._delay(op, step)
        with self._lock:
            for i, left in self._storage.items():
                f = self._storage_faults[i]
                if left > 0 and isinstance(f, StorageErrorFault) and f.op == op:
                    self._storage[i] = left - 1
                    raise InjectedStorageError(
                        f"injected storage error ({op}, {f.times - left + 1} of {f.times})"
                    )

    def _delay(self, op: str, step: int) -> None:
        """``slow_storage``: the storage takes this long for ``op`` on the snapshot of
        ``step``."""
        for slow in self._slow:
            if slow.op == op and step >= slow.from_step:
                time.sleep(slow.seconds)

    def truncate_due(self, step: int) -> bool:
        return self._take(TruncateSnapshotFault, step, at_or_after=True)

    def _take_first(self, match: Callable[[Fault], bool], step: int) -> Fault | None:
        """Remove and journal the first pending fault ``match`` accepts (once per run)."""
        with self._lock:
            for f in self._pending:
                if match(f):
                    self._pending.remove(f)
                    self.journal.write(
                        "fault", step, {"key": fault_key(f), "fault": f.model_dump()}
                    )
                    return f
        return None

    def persist_phase(self, phase: str, step: int) -> None:
        """``kill_persist``: SIGKILL this rank in ``phase`` of the durable write of ``step``
        (the store's hook; called from the writer thread)."""
        if phase == "parts":
            self._delay("commit", step)
        if self._take_first(
            lambda f: isinstance(f, KillPersistFault) and f.phase == phase and step >= f.step,
            step,
        ):
            os.kill(os.getpid(), signal.SIGKILL)

    def corrupt_manifest_due(self, step: int) -> str | None:
        """How to damage the manifest of the snapshot of ``step`` just committed, if due."""
        f = self._take_first(lambda f: isinstance(f, CorruptManifestFault) and step >= f.step, step)
        return f.how if isinstance(f, CorruptManifestFault) else None

    @staticmethod
    def corrupt_manifest(store: DurableStore, step: int, how: str) -> None:
        """``corrupt_manifest``: damage manifest.json of a committed snapshot in place."""
        path = store.path(step_dir(step), "manifest.json")
        with store.fs.open(path, "rb") as f:
            data = f.read()
        if how == "garbage":
            data = os.urandom(max(len(data), 64))
        elif how == "truncate":
            data = data[: len(data) // 2]
        else:  # valid JSON, another shape
            doc = json.loads(data)
            doc["files"] = sorted(doc["files"])
            data = json.dumps(doc).encode()
        with store.fs.open(path, "wb") as f:
            f.write(data)

    def miss_health(self, entered: bool = False) -> None:
        """``miss_health``: never enter the health check (block, as a rank hung elsewhere);
        with ``stop``, once ``entered`` (after the roll call), stop this process (SIGSTOP)."""
        f = self._take_first(
            lambda f: isinstance(f, MissHealthFault) and bool(f.stop) == entered, -1
        )
        if f is None:
            return
        if entered:
            os.kill(os.getpid(), signal.SIGSTOP)  # frozen until SIGCONT or SIGKILL
            return
        while True:
            time.sleep(3600)

    @staticmethod
    def truncate(store: DurableStore, step: int) -> str:
        """``truncate_snapshot``: cut the largest tensor file of rank 0's part of a committed
        snapshot in half (validation on resume must catch it)."""
        part = store.path(step_dir(step), "rank_0")
        files = [i for i in store.fs.ls(part, detail=True) if i["name"].endswith(".distcp")]
        victim = max(files, key=lambda i: i["size"])["name"]
        with store.fs.open(victim, "rb") as f:
            data = f.read()
        with store.fs.open(victim, "wb") as f:
            f.write(data[: len(data) // 2])
        return str(victim)
