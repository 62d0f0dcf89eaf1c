"""`orchestrator drill`: every fault on every engine, on this machine and its storage.

Before trusting a month-long run to it, run the matrix: each cell trains the example GPT
under the supervisor (``orchestrator launch``) with one fault injected, in a run directory
of its own, and is judged against a clean run of the same
engine: did it survive (or stop with the documented exit code), is its final state bit for
bit the clean run's where the fault promises it, how long from the fault to the next
completed step, how many steps were recomputed, and whether any committed snapshot or
quarantine entry was lost (:mod:`orchestrator.audit`; must be none).

The user's policy (``--policy``) is the base, so the drill exercises their storage
(``persist.url``: each cell writes under ``<url>/drill/<engine>/<fault>``), signing key and
retry settings; the drill sets what makes cells short and comparable: snapshots every 5
steps, durable writes every 10, supervisor timings of seconds, and no LR change after an
incident (``adjust.lr_factor: 1``, so a replay can be compared bit for bit). The cell's
fault list is a file of its own (``$ORCHESTRATOR_FAULTS``), apart from the policy it tests.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from orchestrator.errors import EXIT_GAVE_UP, EXIT_PREEMPTED, EXIT_UNHEALTHY
from orchestrator.journal import read_journal, read_metrics
from orchestrator.policy import load_policy, parse_policy
from orchestrator.protocol import ENV_FAULTS, LEDGER_NAME

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
MARKER = "drill.json"  # an --out folder holding this is a drill's: it may be reused
BEGIN, END = "<!-- drill:begin -->", "<!-- drill:end -->"
SEED, SAMPLES, BATCH = 7, 1024, 8  # the examples' data (sampler seed, samples, batch per rank)


@dataclass(frozen=True)
class Engine:
    name: str
    script: str
    args: tuple[str, ...]
    needs: str | None = None  # a module that must be importable


ENGINES = (
    Engine("ddp", "train_gpt.py", ()),
    Engine("fsdp2", "train_gpt.py", ("--fsdp",)),
    Engine("fsdp1", "train_gpt.py", ("--fsdp1",)),
    Engine("zero1", "train_gpt_deepspeed.py", ("--zero-stage", "1"), "deepspeed"),
    Engine("zero2", "train_gpt_deepspeed.py", ("--zero-stage", "2"), "deepspeed"),
    Engine("zero3", "train_gpt_deepspeed.py", ("--zero-stage", "3"), "deepspeed"),
)


@dataclass(frozen=True)
class Fault:
    """One column of the matrix. ``faults(world)``: the policy's fault list; ``expect``: the
    exit code the job must end with; ``bitwise``: whether its final state must equal the
    clean run's; ``again``: then run the same command again, which must finish."""

    name: str
    what: str
    faults: Callable[[int], list[dict[str, Any]]]
    expect: int = 0
    bitwise: bool = True
    policy: dict[str, Any] = field(default_factory=dict)
    again: bool = False
    reference: str = "clean"  # which clean run it is compared with
    tier: str | None = None  # the tier the restart must resume from (else the cell fails)
    replicas: bool = False  # only where ranks hold the state alike (replica digests)


def _poison_id(world: int, step: int = 17) -> int:
    """A sample the examples first meet at ``step``, on the last rank."""
    from orchestrator.data import GuardBatchSampler

    sampler = GuardBatchSampler(SAMPLES, BATCH, rank=0, world_size=world, seed=SEED)
    return int(sampler.global_batch_at(0, step * BATCH * world)[world * BATCH - 3])


FAULTS = (
    Fault("nan", "NaN gradient at step 23 (last rank)",
          lambda w: [{"kind": "nan_grad", "step": 23, "rank": w - 1}]),
    Fault("poison", "a sample that is NaN every time (step 17)",
          lambda w: [{"kind": "poison_sample", "sample": _poison_id(w)}], reference="poison"),
    Fault("crash", "SIGKILL of the last rank at step 27",
          lambda w: [{"kind": "crash", "step": 27, "rank": w - 1}]),
    Fault("hang", "rank 0 blocks forever at step 27",
          lambda w: [{"kind": "hang", "step": 27, "rank": 0}]),
    Fault("preempt", "SIGTERM to the supervisor at step 25, then the same command",
          lambda w: [{"kind": "preempt", "step": 25}], expect=EXIT_PREEMPTED, again=True),
    Fault("storage", "3 durable writes fail (transient)",
          lambda w: [{"kind": "storage_error", "op": "write", "times": 3}]),
    Fault("kill_write", "rank 0 killed between manifest and COMMITTED (step 20)",
          lambda w: [{"kind": "kill_persist", "phase": "manifest", "step": 20}]),
    Fault("bad_manifest", "manifest of step 20 garbage, then a crash at 27",
          lambda w: [{"kind": "corrupt_manifest", "step": 20},
                     {"kind": "crash", "step": 27, "rank": w - 1, "after_persist": True}]),
    Fault("bad_shm", "newest shared-memory slot corrupted, then a crash at 27",
          lambda w: [{"kind": "corrupt_shm", "step": 26, "rank": 0},
                     {"kind": "crash", "step": 27, "rank": w - 1}],
          policy={"snapshot": {"shared_memory": True}}, tier="shm"),
    Fault("divergence", "the last rank's weights drift by 1e-3 at step 25 (a snapshot step)",
          lambda w: [{"kind": "perturb_params", "step": 25, "rank": w - 1}], replicas=True),
    Fault("lr_blowup", "the LR 100x from step 24 for 10 steps (a broken schedule)",
          lambda w: [{"kind": "lr_blowup", "step": 24, "factor": 100.0, "steps": 10}]),
    Fault("crash_sample", "a sample that raises in the loop body (step 17), every attempt",
          lambda w: [{"kind": "crash_sample", "sample": _poison_id(w)}], reference="poison"),
    Fault("broken", "NaN gradients on every step from 25 (a model broken for good)",
          lambda w: [{"kind": "broken_grads", "step": 25, "rank": w - 1}],
          expect=EXIT_GAVE_UP, bitwise=False),
    Fault("unhealthy", "rank 0's collectives carry a wrong value (pre-flight)",
          lambda w: [{"kind": "corrupt_allreduce", "rank": 0}], expect=EXIT_UNHEALTHY,
          bitwise=False, policy={"health": {"preflight": True, "timeout_s": 20}}),
    Fault("absent", "the last rank never enters the health check",
          lambda w: [{"kind": "miss_health", "rank": w - 1}], expect=EXIT_UNHEALTHY,
          bitwise=False, policy={"health": {"preflight": True, "timeout_s": 10}}),
)  # fmt: skip
# Engines whose model state is sharded: no two ranks hold it alike.
SHARDED = frozenset({"fsdp2", "fsdp1", "zero3"})
QUICK = ("nan", "crash", "hang", "preempt", "kill_write", "bad_manifest")

DRILL_POLICY: dict[str, Any] = {
    "snapshot": {"every_steps": 5, "keep": 3},
    "persist": {"every_steps": 10, "keep": 3},
    "adjust": {"lr_factor": 1.0},
    "supervisor": {
        "backoff_s": 0.5,
        "backoff_max_s": 2.0,
        "hang_timeout_s": 10.0,
        "heartbeat_interval_s": 0.5,
        "grace_s": 20.0,
        "max_unhealthy": 0,
    },
}


@dataclass
class Cell:
    engine: str
    fault: str
    what: str
    expected: str
    outcome: str = ""
    passed: bool = False
    exit_codes: list[int] = field(default_factory=list)
    bitwise: str = "-"  # yes, NO, or - (not promised)
    recovery_s: float | None = None  # fault -> next completed step
    steps_lost: int | None = None
    data_lost: list[str] = field(default_factory=list)
    seconds: float = 0.0
    run_dir: str = ""


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Drill:
    def __init__(
        self,
        out: Path,
        engines: list[Engine],
        faults: list[Fault],
        base_policy: dict[str, Any],
        nproc: int,
        steps: int,
        timeout_s: float,
    ) -> None:
        self.out, self.engines, self.faults = out, engines, faults
        self.base, self.nproc, self.steps, self.timeout_s = base_policy, nproc, steps, timeout_s
        self.url = (base_policy.get("persist") or {}).get("url")
        self.cells: list[Cell] = []

    # --- one run --------------------------------------------------------------------------
    def _policy(
        self, engine: Engine, name: str, fault: Fault | None
    ) -> tuple[dict[str, Any], str | None]:
        policy = _merge(self.base, DRILL_POLICY)
        url = None
        if self.url:  # the user's storage, a prefix per cell
            url = f"{self.url.rstrip('/')}/drill/{engine.name}/{name}"
            policy = _merge(policy, {"persist": {"url": url}})
        if fault is not None:
            policy = _merge(policy, fault.policy)
            # Its faults travel apart from the policy (the cell's faults file): check them too.
            parse_policy({"faults": fault.faults(self.nproc)}, source=f"<drill {name}>")
        policy["faults"] = []
        parse_policy(policy, source=f"<drill {engine.name}/{name}>")  # fails here, not in a rank
        return policy, url

    def _cmd(self, engine: Engine, run_dir: Path, policy_path: Path) -> list[str]:
        return [
            sys.executable, "-m", "launch.cli", "launch", "--policy", str(policy_path),
            "--run-dir", str(run_dir), "--", sys.executable, "-m", "torch.distributed.run",
            "--nproc-per-node", str(self.nproc), "--master-addr", "127.0.0.1",
            "--master-port", str(_free_port()), str(EXAMPLES / engine.script), *engine.args,
            "--steps", str(self.steps), "--save-final", str(run_dir / "final"),
        ]  # fmt: skip

    def _start(
        self, cmd: list[str], log: Path, faults: Path | None = None
    ) -> subprocess.Popen[bytes]:
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        env.pop(ENV_FAULTS, None)  # a clean run is clean
        if faults is not None:
            env[ENV_FAULTS] = str(faults)
        with open(log, "ab") as f:
            return subprocess.Popen(
                cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                cwd=EXAMPLES.parent,
            )  # fmt: skip

    def _wait(self, proc: subprocess.Popen[bytes]) -> int:
        try:
            return proc.wait(self.timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return -9

    def _prepare(self, run_dir: Path, ledger: list[int] | None = None) -> None:
        if run_dir.exists():
            shutil.rmtree(run_dir)
        run_dir.mkdir(parents=True)
        if ledger:
            (run_dir / LEDGER_NAME).write_text(
                "".join(json.dumps({"sample": i}) + "\n" for i in ledger)
            )

    def reference(self, engine: Engine, kind: str) -> tuple[Path, int]:
        """A clean run of ``engine`` (``poison``: its ledger holding the poison sample)."""
        run_dir = self.out / engine.name / f"_{kind}"
        self._prepare(run_dir, [_poison_id(self.nproc)] if kind == "poison" else None)
        policy, _ = self._policy(engine, f"_{kind}", None)
        path = run_dir.parent / f"_{kind}.yaml"
        path.write_text(yaml.safe_dump(policy))
        proc = self._start(self._cmd(engine, run_dir, path), run_dir.parent / f"_{kind}.log")
        return run_dir, self._wait(proc)

    def cell(self, engine: Engine, fault: Fault, reference: tuple[Path, int]) -> Cell:
        run_dir = self.out / engine.name / fault.name
        if fault.replicas and engine.name in SHARDED:
            return Cell(engine.name, fault.name, fault.what, "-", passed=True, run_dir="",
                        outcome="n/a: sharded state, no replicas to compare")  # fmt: skip
        self._prepare(run_dir)
        policy, url = self._policy(engine, fault.name, fault)
        path = run_dir.parent / f"{fault.name}.yaml"
        path.write_text(yaml.safe_dump(policy))
        faults = run_dir.parent / f"{fault.name}.faults.yaml"
        faults.write_text(yaml.safe_dump(fault.faults(self.nproc)))
        log = run_dir.parent / f"{fault.name}.log"
        expected = "exit 0" if fault.expect == 0 else f"exit {fault.expect}"
        if fault.again:
            expected = f"exit {fault.expect}, then 0"
        c = Cell(engine.name, fault.name, fault.what, expected, run_dir=str(run_dir))
        t0 = time.monotonic()
        cmd = self._cmd(engine, run_dir, path)
        c.exit_codes.append(self._wait(self._start(cmd, log, faults)))
        if fault.again and c.exit_codes[0] == fault.expect:
            c.exit_codes.append(self._wait(self._start(cmd, log, faults)))  # the same again
        c.seconds = round(time.monotonic() - t0, 1)
        want = [fault.expect, 0] if fault.again else [fault.expect]
        survived = c.exit_codes == want
        c.outcome = "survived" if survived and fault.expect == 0 else (
            f"stopped with {fault.expect} as expected" if survived else
            f"FAILED: exit {', '.join(map(str, c.exit_codes))} (expected {expected})"
        )  # fmt: skip
        if fault.bitwise and survived:
            ref_dir, ref_code = reference
            same = ref_code == 0 and _same_final(ref_dir / "final", run_dir / "final")
            c.bitwise = "yes" if same else "NO"
        c.recovery_s, c.steps_lost = _recovery(run_dir)
        c.data_lost = _audit(run_dir, url)
        tiers = [
            e["details"].get("tier") for e in read_journal(str(run_dir)) if e["kind"] == "resume"
        ]
        wrong_tier = fault.tier is not None and tiers[:1] != [fault.tier]
        if survived and wrong_tier:  # it survived, but not the way the fault promises
            c.outcome = f"FAILED: resumed from {tiers[:1] or 'nothing'}, not {fault.tier}"
        c.passed = survived and not wrong_tier and c.bitwise != "NO" and not c.data_lost
        return c

    # --- the matrix -----------------------------------------------------------------------
    def run(self, say: Callable[[str], None]) -> list[Cell]:
        for engine in self.engines:
            refs: dict[str, tuple[Path, int]] = {}
            for fault in self.faults:
                if fault.bitwise and fault.reference not in refs:
                    say(f"{engine.name}: clean run ({fault.reference})")
                    refs[fault.reference] = self.reference(engine, fault.reference)
                    if refs[fault.reference][1] != 0:
                        say(
                            f"{engine.name}: the clean run failed (exit {refs[fault.reference][1]})"
                        )
                c = self.cell(engine, fault, refs.get(fault.reference, (Path(), 1)))
                self.cells.append(c)
                say(f"{engine.name} {fault.name}: {c.outcome}, bit for bit {c.bitwise}, "
                    f"{len(c.data_lost)} lost ({c.seconds:.0f} s)")  # fmt: skip
                self.save()
        return self.cells

    def save(self) -> None:
        doc = {"machine": machine(), "nproc": self.nproc, "steps": self.steps,
               "cells": [asdict(c) for c in self.cells]}  # fmt: skip
        (self.out / MARKER).write_text(json.dumps(doc, indent=1))
        (self.out / "drill.md").write_text(table(self.cells, self.nproc) + "\n")


def _same_final(a: Path, b: Path) -> bool:
    """Every rank's final state (whole tensors, bytes compared) is the same in both runs."""
    import torch

    fa, fb = sorted(a.glob("rank*.pt")), sorted(b.glob("rank*.pt"))
    if not fa or [f.name for f in fa] != [f.name for f in fb]:
        return False
    return all(
        _equal(torch.load(x, weights_only=True), torch.load(y, weights_only=True))
        for x, y in zip(fa, fb, strict=True)
    )


def _equal(a: Any, b: Any) -> bool:
    import torch

    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
        )  # fmt: skip
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return (
            isinstance(b, (list, tuple)) and len(a) == len(b)
            and all(_equal(x, y) for x, y in zip(a, b, strict=True))
        )  # fmt: skip
    return bool(a == b)


def _recovery(run_dir: Path) -> tuple[float | None, int | None]:
    """(seconds from the fault to the next completed step, steps recomputed) from the
    journal and metrics; (None, None) for a fault that interrupted nothing."""
    events = list(read_journal(str(run_dir)))
    faults = [e for e in events if e["kind"] == "fault"]
    recovered = [e for e in events if e["kind"] == "recovered"]
    if faults:
        at, step = float(faults[-1]["time"]), int(faults[-1]["step"])
    elif recovered:  # a fault that journals no event of its own (a poison sample)
        inc = recovered[0]["details"]["incident"]
        at, step = float(inc["started_at"]), int(inc["step"])
    else:
        return None, None
    back = [e for e in events if e["time"] > at and e["kind"] in ("rollback", "resume")]
    if not back:
        return None, None
    to = back[0]["details"]["to_step" if back[0]["kind"] == "rollback" else "snapshot_step"]
    # The first step completed after the state was restored (steps a preempted job still
    # finished before it stopped are not a recovery).
    rows = [r for r in read_metrics(str(run_dir)) if float(r["time"]) > back[0]["time"]]
    recovery = round(float(rows[0]["time"]) - at, 2) if rows else None
    return recovery, max(0, step - int(to))


def _audit(run_dir: Path, url: str | None) -> list[str]:
    from orchestrator.audit import audit
    from orchestrator.store import signing_key

    try:
        policy = load_policy(run_dir / "policy.yaml")
        key = signing_key(policy.persist.signing_key_file)
        return audit(str(run_dir), url, policy.quarantine.ledger_url, key)
    except Exception as err:  # the audit itself failed: that is a finding, not a pass
        return [f"audit failed: {err!r}"]


def machine() -> str:
    """What the drill ran on, for the table's heading."""
    cores = os.cpu_count() or 0
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            mem = f"{int(f.readline().split()[1]) / 2**20:.0f} GiB"
    except (OSError, ValueError, IndexError):
        mem = "? GiB"
    import torch

    gpu = (
        f"{torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}"
        if torch.cuda.is_available()
        else "no GPU"
    )
    parts = [f"{platform.system()} {platform.machine()}", f"{cores} CPU cores", mem, gpu,
             f"torch {torch.__version__}"]  # fmt: skip
    if importlib.util.find_spec("deepspeed") is not None:
        from importlib.metadata import version

        parts.append(f"deepspeed {version('deepspeed')}")
    return ", ".join(parts)


def table(cells: list[Cell], nproc: int) -> str:
    head = (
        f"Fault drill, {time.strftime('%Y-%m-%d')}, {machine()}; {nproc} ranks per run "
        f"(`orchestrator drill`). {sum(c.passed for c in cells)} of {len(cells)} cells pass.\n\n"
        "| engine | fault | expected | outcome | bit for bit | fault -> next step | steps lost "
        "| data lost |\n|---|---|---|---|---|---|---|---|"
    )
    rows = [
        f"| {c.engine} | {c.fault}: {c.what} | {c.expected} | {c.outcome} | {c.bitwise} | "
        f"{'-' if c.recovery_s is None else f'{c.recovery_s:.1f} s'} | "
        f"{'-' if c.steps_lost is None else c.steps_lost} | "
        f"{'none' if not c.data_lost else f'{len(c.data_lost)}: {c.data_lost[0]}'} |"
        for c in cells
    ]
    return "\n".join([head, *rows])


def update_readme(path: Path, md: str) -> None:
    """Put the generated table between the drill markers of ``path``."""
    text = path.read_text(encoding="utf-8")
    if BEGIN not in text or END not in text:
        raise ValueError(f"{path} has no {BEGIN} ... {END} block for the drill's table")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    path.write_text(f"{head}{BEGIN}\n{md}\n{END}{tail}", encoding="utf-8")


def choose(names: str | None, pool: tuple[Any, ...], what: str) -> list[Any]:
    if names is None:
        return list(pool)
    by = {x.name: x for x in pool}
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in by]
    if unknown:
        raise ValueError(f"unknown {what} {unknown}; known: {', '.join(by)}")
    return [by[n] for n in wanted]


def run_drill(
    out: str | None,
    quick: bool,
    engines: str | None,
    faults: str | None,
    policy_path: str | None,
    nproc: int,
    steps: int,
    readme: str | None,
) -> int:
    """The CLI's ``drill``: returns 0 when every cell passes, 1 otherwise, 2 on bad input."""
    if not (EXAMPLES / "train_gpt.py").exists():
        print(f"the drill runs the examples in {EXAMPLES}, which are not here: run it from a "
              "checkout installed with `pip install -e .`", file=sys.stderr)  # fmt: skip
        return 2
    if steps < 30:
        print("--steps: the faults fire up to step 27; give it 30 or more", file=sys.stderr)
        return 2
    installed = [e for e in ENGINES if e.needs is None or importlib.util.find_spec(e.needs)]
    chosen_engines = choose(engines or ("ddp" if quick else None), tuple(installed), "engines")
    chosen_faults = choose(faults or (",".join(QUICK) if quick else None), FAULTS, "faults")
    base = load_policy(policy_path).model_dump(mode="json", exclude={"faults"})
    out_dir = Path(out or f"drill-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    if out_dir.exists() and any(out_dir.iterdir()) and not (out_dir / MARKER).exists():
        print(f"{out_dir} holds files that are not a drill's: choose another --out",
              file=sys.stderr)  # fmt: skip
        return 2
    out_dir.mkdir(parents=True, exist_ok=True)
    drill = Drill(out_dir, chosen_engines, chosen_faults, base, nproc, steps, timeout_s=600)
    print(f"[drill] {len(chosen_engines)} engine(s) x {len(chosen_faults)} fault(s) into "
          f"{out_dir}", flush=True)  # fmt: skip
    cells = drill.run(lambda line: print(f"[drill] {line}", flush=True))
    md = table(cells, nproc)
    print("\n" + md)
    if readme:
        update_readme(Path(readme), md)
    return 0 if all(c.passed for c in cells) else 1
