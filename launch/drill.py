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
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import yaml

from launch.drill_judge import _audit, _in_place, _recovery, _same_final
from launch.drill_matrix import (
    BATCH,
    DRILL_POLICY,
    ENGINES,
    FAULTS,
    IN_PLACE,
    QUICK,
    SAMPLES,
    SEED,
    SHARDED,
    Cell,
    Engine,
    Fault,
    _poison_id,
    choose,
)
from launch.drill_report import BEGIN, END, machine, table, update_readme
from orchestrator.journal import read_journal
from orchestrator.policy import load_policy, parse_policy
from orchestrator.protocol import ENV_FAULTS, LEDGER_NAME

# The matrix, the judging and the report are re-exported: ``from launch.drill import X`` stays.
__all__ = [
    "BATCH",
    "BEGIN",
    "DRILL_POLICY",
    "END",
    "ENGINES",
    "FAULTS",
    "QUICK",
    "SAMPLES",
    "SEED",
    "SHARDED",
    "Cell",
    "Drill",
    "Engine",
    "Fault",
    "_same_final",
    "choose",
    "machine",
    "run_drill",
    "table",
    "update_readme",
]

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
MARKER = "drill.json"  # an --out folder holding this is a drill's: it may be reused


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

    def _cmd(
        self, engine: Engine, run_dir: Path, policy_path: Path, agent: bool = False
    ) -> list[str]:
        """Under the supervisor: torchrun, or the node agent (in-place recovery)."""
        launcher = ["--nproc-per-node", str(self.nproc)] if agent else [
            "--", sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
            str(self.nproc), "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
        ]  # fmt: skip
        return [
            sys.executable, "-m", "launch.cli", "launch", "--policy", str(policy_path),
            "--run-dir", str(run_dir), *launcher, str(EXAMPLES / engine.script), *engine.args,
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
        cmd = self._cmd(engine, run_dir, path, fault.agent)
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
        if fault.agent:
            c.in_place = _in_place(run_dir)
        # Promised in place (IN_PLACE) but restarted every rank: survived, not the promised way.
        not_in_place = fault.agent and engine.name in IN_PLACE and c.in_place.startswith("no")
        if survived and not_in_place:
            c.outcome = f"FAILED: restarted every rank ({c.in_place})"
        c.passed = (
            survived and not wrong_tier and not not_in_place and c.bitwise != "NO"
            and not c.data_lost
        )  # fmt: skip
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
