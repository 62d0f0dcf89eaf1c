"""The policy's ``faults`` list: one pydantic model per fault kind, told apart by ``kind``.

What each fault does is in :mod:`orchestrator.faults`; these models only validate the YAML
(test-only: drills and tests; production policies leave the list empty).
"""

from __future__ import annotations

from typing import Annotated, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Fault(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


class _StepFault(_Fault):
    step: int = Field(ge=0, description="Step at which the fault fires (0-based).")
    rank: int = Field(0, ge=0, description="Global rank on which it fires.")
    attempt: int | None = Field(
        None,
        ge=0,
        description="Only in this attempt of the supervisor (a fault in a resumed attempt: "
        "a crash loop); null: the first time the step is reached.",
    )


class _MicroFault(_StepFault):
    micro: int = Field(
        0, ge=0, description="Micro-batch of the step it fires in (gradient accumulation)."
    )


class NanGradFault(_MicroFault):
    kind: Literal["nan_grad"]


class InfLossFault(_MicroFault):
    kind: Literal["inf_loss"]


class PoisonSampleFault(_Fault):
    kind: Literal["poison_sample"]
    sample: int = Field(ge=0, description="Dataset index whose batches get a non-finite loss.")


class CrashFault(_StepFault):
    kind: Literal["crash"]
    after_persist: bool = Field(
        False,
        description="First wait (up to persist.commit_timeout_s) until this rank's durable "
        "writes in flight are done (on rank 0, which commits them: committed), so the crash "
        "lands right after a known durable snapshot instead of racing its write.",
    )


class HangFault(_StepFault):
    kind: Literal["hang"]


class ExitFault(_StepFault):
    kind: Literal["exit"]
    code: int = Field(1, ge=0, le=255, description="Exit code of the process.")


class PreemptFault(_StepFault):
    """At this step the rank sends SIGTERM to its supervisor ($ORCHESTRATOR_SUPERVISOR_PID),
    as a scheduler preempting the job would (to itself without a supervisor): the stop
    arrives at a known step, however fast the steps run."""

    kind: Literal["preempt"]


class CorruptShmFault(_StepFault):
    """Flip bytes of this rank's newest sealed shared-memory slot (snapshot.shared_memory),
    after its verdict was written: memory gone bad under a snapshot a restart would trust."""

    kind: Literal["corrupt_shm"]


class PerturbParamsFault(_StepFault):
    """At the start of this step, before its snapshot and its forward, add ``by`` to every
    element of this rank's parameters, outside anything the Guard does: a replica drifting
    (silent data corruption, a loop that skips a gradient all-reduce) that stays finite."""

    kind: Literal["perturb_params"]
    by: float = Field(1e-3, description="Added to every parameter element.")


class LrBlowupFault(_StepFault):
    """From this step the optimizer applies ``factor`` times the LR for ``steps`` steps, as
    a broken schedule would: finite divergence, not a NaN. Over at the first rollback."""

    kind: Literal["lr_blowup"]
    factor: float = Field(10.0, gt=0, description="LR multiplier while it lasts.")
    steps: int = Field(10, ge=1, description="How many steps it lasts.")


class OutlierSampleFault(_Fault):
    """This sample's loss is ``extra`` higher (finite): a batch holding it has its mean loss
    raised by ``extra`` / (samples in the batch), as a dirty sample's would be."""

    kind: Literal["outlier_sample"]
    sample: int = Field(ge=0, description="Dataset index of the outlier.")
    extra: float = Field(20.0, gt=0, description="Added to that sample's loss.")


class CrashSampleFault(_Fault):
    """A batch holding this sample kills its rank in the loop body, every time (real
    passes and re-runs alike), as a token id past the vocabulary does in an embedding."""

    kind: Literal["crash_sample"]
    sample: int = Field(ge=0, description="Dataset index of the sample that kills.")
    how: Literal["raise", "kill"] = Field(
        "raise", description="raise: IndexError in the loop body; kill: SIGKILL (an OOM kill)."
    )


class BrokenGradsFault(_Fault):
    """From this step on, every step's gradients hold a NaN (a model broken for good, its
    loss finite): with a loss scaler, every step an overflow skip."""

    kind: Literal["broken_grads"]
    step: int = Field(ge=0, description="The first broken step.")
    rank: int = Field(0, ge=0, description="Global rank whose gradients break.")


class StorageErrorFault(_Fault):
    kind: Literal["storage_error"]
    op: Literal["write", "read"] = Field("write", description="Which storage operations fail.")
    times: int = Field(1, ge=1, description="How many operations fail before storage heals.")
    rank: int | None = Field(None, ge=0, description="Only on this rank (null: every rank).")


class SlowStorageFault(_Fault):
    kind: Literal["slow_storage"]
    op: Literal["write", "read", "commit"] = Field(
        "write",
        description="Which operations are slow (commit: rank 0 between the last part and "
        "the manifest, a write half done).",
    )
    seconds: float = Field(gt=0, description="Added latency per operation.")
    rank: int | None = Field(None, ge=0, description="Only on this rank (null: every rank).")
    from_step: int = Field(0, ge=0, description="Only for snapshots of this step or later.")


class SlowStepsFault(_Fault):
    """Every step on a rank takes longer (a throttled host, a slow GPU). Also how a test
    paces a tiny model's training, so that what it does mid-run (a network cut, a host
    killed) happens mid-run however late a loaded machine lets it look."""

    kind: Literal["slow_steps"]
    seconds: float = Field(gt=0, description="Added to every step, before it is judged.")
    rank: int | None = Field(None, ge=0, description="Only on this rank (null: every rank).")


class CorruptAllreduceFault(_Fault):
    kind: Literal["corrupt_allreduce"]
    rank: int = Field(ge=0, description="This rank's contributions to health checks are wrong.")


class SlowRankFault(_Fault):
    kind: Literal["slow_rank"]
    rank: int = Field(ge=0, description="This rank is slow in the bandwidth check.")
    factor: float = Field(4.0, gt=1, description="How many times slower.")


class FlakyComputeFault(_Fault):
    kind: Literal["flaky_compute"]
    rank: int = Field(ge=0, description="This rank's compute self-test result is off.")


class NanModuleFault(_Fault):
    kind: Literal["nan_module"]
    module: str = Field(description="Qualified module name, e.g. blocks.2.attn.")
    step: int = Field(ge=0, description="Its forward output turns NaN at this step.")
    rank: int | None = Field(None, ge=0, description="Only on this rank (null: every rank).")


class TruncateSnapshotFault(_Fault):
    kind: Literal["truncate_snapshot"]
    step: int = Field(
        ge=0, description="Truncate a file of the first snapshot committed at or after this step."
    )


class KillPersistFault(_Fault):
    """Kill the rank (SIGKILL) in one phase of a durable write: what a node lost mid-write
    leaves behind must never be trusted, and nothing committed before may be lost."""

    kind: Literal["kill_persist"]
    phase: Literal["part", "parts", "manifest", "prune"] = Field(
        description="part: during this rank's part (its tensors written, its index not yet); "
        "parts: rank 0, every part written, before manifest.json; manifest: rank 0, after "
        "manifest.json, before COMMITTED; prune: rank 0, during retention's delete of an older "
        "snapshot (its marker gone, its files not yet)."
    )
    step: int = Field(ge=0, description="In the first durable write at or after this step.")
    rank: int = Field(0, ge=0, description="The rank killed (phases other than part: 0).")

    @model_validator(mode="after")
    def _committer(self) -> KillPersistFault:
        if self.phase != "part" and self.rank != 0:
            raise ValueError(f"phase {self.phase!r} happens on rank 0 only (it commits)")
        return self


class CorruptManifestFault(_Fault):
    """Damage manifest.json of a committed snapshot (its COMMITTED marker stays): validation
    on resume must refuse it and fall back to an older snapshot."""

    kind: Literal["corrupt_manifest"]
    step: int = Field(
        ge=0, description="The first snapshot committed at or after this step is damaged."
    )
    how: Literal["garbage", "truncate", "shape"] = Field(
        "garbage",
        description="garbage: random bytes; truncate: its first half; shape: valid JSON of "
        "another shape (files as a list).",
    )


class MissHealthFault(_Fault):
    """This rank never enters the first health check it should run (it blocks, as a rank
    hung elsewhere does), or, with ``stop``, enters it and freezes: the others must time out,
    name it, and not hang."""

    kind: Literal["miss_health"]
    rank: int = Field(ge=0, description="The rank that stays away.")
    stop: bool | None = Field(
        None,
        description="true: the rank enters the check (the roll call) and then stops itself "
        "with SIGSTOP, as a debugger or a stalled kernel freezes a process (every thread "
        "stops); the others name it as entered but silent. Unset: it never enters.",
    )


Fault = Annotated[
    NanGradFault
    | InfLossFault
    | PoisonSampleFault
    | CrashFault
    | HangFault
    | ExitFault
    | PreemptFault
    | CorruptShmFault
    | PerturbParamsFault
    | LrBlowupFault
    | OutlierSampleFault
    | CrashSampleFault
    | BrokenGradsFault
    | StorageErrorFault
    | SlowStorageFault
    | SlowStepsFault
    | TruncateSnapshotFault
    | CorruptAllreduceFault
    | SlowRankFault
    | FlakyComputeFault
    | NanModuleFault
    | KillPersistFault
    | CorruptManifestFault
    | MissHealthFault,
    Field(discriminator="kind"),
]
# The tags pydantic puts in error locations of the union (not part of the YAML path).
FAULT_KINDS = frozenset(
    get_args(member.model_fields["kind"].annotation)[0] for member in get_args(get_args(Fault)[0])
)
