"""The policy: one YAML file, validated by pydantic v2 models (one per section; the fault
models of the ``faults`` list are in :mod:`orchestrator.fault_kinds`).

Every model forbids unknown keys, so a typo is an error naming its YAML path rather than a
silently ignored setting. ``configs/default.yaml`` documents every field and must stay in
sync with the defaults here (a test checks it).
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import yaml
from pydantic import Field, ValidationError, model_validator

from orchestrator.errors import PolicyError
from orchestrator.fault_kinds import (
    FAULT_KINDS,
    CorruptAllreduceFault,
    CrashFault,
    ExitFault,
    Fault,
    FlakyComputeFault,
    HangFault,
    InfLossFault,
    NanGradFault,
    NanModuleFault,
    PoisonSampleFault,
    SlowRankFault,
    SlowStorageFault,
    StorageErrorFault,
    TruncateSnapshotFault,
)
from orchestrator.policy_sections import (
    AdjustPolicy,
    AlertsPolicy,
    ClipPolicy,
    DetectPolicy,
    DiagnosePolicy,
    EscalationPolicy,
    ExportPolicy,
    HealthPolicy,
    MetricsPolicy,
    PersistPolicy,
    QuarantinePolicy,
    SnapshotPolicy,
    SpikePolicy,
    SupervisorPolicy,
    TunePolicy,
    _Section,
)
from orchestrator.protocol import ENV_POLICY

# The section and fault models are re-exported: ``from orchestrator.policy import X`` stays.
__all__ = [
    "AdjustPolicy",
    "AlertsPolicy",
    "ClipPolicy",
    "CorruptAllreduceFault",
    "CrashFault",
    "DetectPolicy",
    "DiagnosePolicy",
    "ENV_POLICY",
    "EscalationPolicy",
    "ExitFault",
    "ExportPolicy",
    "Fault",
    "FlakyComputeFault",
    "HangFault",
    "HealthPolicy",
    "InfLossFault",
    "MetricsPolicy",
    "NanGradFault",
    "NanModuleFault",
    "PersistPolicy",
    "PoisonSampleFault",
    "Policy",
    "QuarantinePolicy",
    "SlowRankFault",
    "SlowStorageFault",
    "SnapshotPolicy",
    "SpikePolicy",
    "StorageErrorFault",
    "SupervisorPolicy",
    "TruncateSnapshotFault",
    "TunePolicy",
    "load_policy",
    "parse_policy",
]


class Policy(_Section):
    """The whole policy. Build it with :func:`load_policy`, or in code: ``Policy(snapshot=...)``."""

    snapshot: SnapshotPolicy = Field(default_factory=SnapshotPolicy)  # type: ignore[arg-type]
    detect: DetectPolicy = Field(default_factory=DetectPolicy)  # type: ignore[arg-type]
    clip: ClipPolicy = Field(default_factory=ClipPolicy)  # type: ignore[arg-type]
    quarantine: QuarantinePolicy = Field(default_factory=QuarantinePolicy)  # type: ignore[arg-type]
    persist: PersistPolicy = Field(default_factory=PersistPolicy)  # type: ignore[arg-type]
    adjust: AdjustPolicy = Field(default_factory=AdjustPolicy)  # type: ignore[arg-type]
    escalation: EscalationPolicy = Field(default_factory=EscalationPolicy)  # type: ignore[arg-type]
    supervisor: SupervisorPolicy = Field(default_factory=SupervisorPolicy)  # type: ignore[arg-type]
    metrics: MetricsPolicy = Field(default_factory=MetricsPolicy)  # type: ignore[arg-type]
    health: HealthPolicy = Field(default_factory=HealthPolicy)  # type: ignore[arg-type]
    diagnose: DiagnosePolicy = Field(default_factory=DiagnosePolicy)  # type: ignore[arg-type]
    tune: TunePolicy = Field(default_factory=TunePolicy)  # type: ignore[arg-type]
    export: ExportPolicy = Field(default_factory=ExportPolicy)  # type: ignore[arg-type]
    alerts: AlertsPolicy = Field(default_factory=AlertsPolicy)  # type: ignore[arg-type]
    faults: list[Fault] = Field(
        default_factory=list,
        description="Test-only: fault injection for drills and tests (empty: no fault code "
        "runs; orchestrator/faults/ wraps the components the faults perturb).",
    )

    @model_validator(mode="after")
    def _clip_needs_the_norm(self) -> Policy:
        if self.clip.max_norm is not None and not self.detect.check_grads:
            raise ValueError(
                "clip.max_norm needs detect.check_grads: true: the Guard clips by the gradient "
                "norm its finite check computes, and with check_grads false it computes none"
            )
        return self

    def digest(self) -> str:
        """Short stable hash of the resolved policy, journaled so runs can be compared."""
        blob = json.dumps(self.model_dump(mode="json"), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:12]


def _yaml_path(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in FAULT_KINDS:
            continue  # discriminator tag pydantic inserts; not part of the YAML path
        else:
            out += f".{part}" if out else str(part)
    return out or "<top level>"


def _format_errors(err: ValidationError, source: str) -> str:
    lines = [f"invalid policy {source}:"]
    for e in err.errors():
        path = _yaml_path(tuple(e["loc"]))
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = "unknown key (check spelling; see configs/default.yaml for every key)"
        got = repr(e.get("input"))
        got = got if len(got) <= 80 else f"{got[:77]}..."
        quiet = ("extra_forbidden", "missing", "value_error")  # value_error: says it already
        shown = "" if e["type"] in quiet else f" (got {got})"
        lines.append(f"  {path}: {msg}{shown}")
    return "\n".join(lines)


def parse_policy(data: Any, source: str = "<dict>") -> Policy:
    """Validate a mapping (already parsed YAML) into a :class:`Policy`.

    Raises:
        PolicyError: naming each offending YAML path and what is allowed.
    """
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise PolicyError(f"invalid policy {source}: the top level must be a mapping of sections")
    try:
        return Policy.model_validate(data)
    except ValidationError as err:
        raise PolicyError(_format_errors(err, source)) from None


def load_policy(path: str | os.PathLike[str] | None = None) -> Policy:
    """Load the policy from ``path``, else ``$ORCHESTRATOR_POLICY``, else built-in defaults.

    Raises:
        PolicyError: the file is missing, not YAML, or not a valid policy.
    """
    if path is None:
        path = os.environ.get(ENV_POLICY) or None
    if path is None:
        return Policy()
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_POLICY_BYTES + 1)
    except FileNotFoundError:
        raise PolicyError(f"policy file {path} does not exist") from None
    except IsADirectoryError:
        raise PolicyError(f"policy file {path} is a directory; name the YAML file") from None
    except OSError as err:
        raise PolicyError(f"policy file {path} cannot be read: {err.strerror}") from None
    if len(raw) > MAX_POLICY_BYTES:
        raise PolicyError(f"policy file {path} is over {MAX_POLICY_BYTES >> 20} MiB: not a policy")
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise PolicyError(
            f"policy file {path} is not UTF-8 text (byte {err.start}: {raw[err.start : err.end]!r})"
        ) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise PolicyError(f"policy file {path} is not valid YAML: {err}") from None
    except RecursionError:
        raise PolicyError(f"policy file {path} nests too deeply to be a policy") from None
    if _expanded_size(data, {}) > MAX_POLICY_VALUES:
        raise PolicyError(
            f"policy file {path} expands to over {MAX_POLICY_VALUES} values (YAML anchors "
            "repeated within each other?): not a policy"
        )
    return parse_policy(data, source=path)


MAX_POLICY_BYTES = 1 << 20
MAX_POLICY_VALUES = 100_000


def _expanded_size(node: Any, seen: dict[int, int]) -> int:
    """How many values ``node`` holds once YAML aliases are expanded (each alias is the same
    object: memoized by id, so a billion-fold expansion is counted, not walked)."""
    if id(node) in seen:
        return seen[id(node)]
    size = 1
    if isinstance(node, dict):
        size += sum(_expanded_size(k, seen) + _expanded_size(v, seen) for k, v in node.items())
    elif isinstance(node, list):
        size += sum(_expanded_size(v, seen) for v in node)
    if isinstance(node, (dict, list)):
        seen[id(node)] = size
    return size
