"""The default ending (issue 28): a 2-rank script that ends after ``guard.close()`` with a
plain return, as most scripts end (no ``exit_process``), exits 0: when a gloo worker thread
frees a collective's tensor as the interpreter finalizes (deterministic; DDP and FSDP1, and
FSDP2 and ZeRO-2 in the full matrix), and with the CPU saturated beside it (DDP and FSDP1;
20 runs each in the full matrix)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import free_port, kinds, spawn, wait

WORKER = Path(__file__).resolve().parent / "ending_worker.py"
ENGINES = ["ddp", "fsdp1"]


@contextlib.contextmanager
def busy_loops(n: int) -> Iterator[None]:
    """``n`` processes spinning on the CPU, killed on the way out."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


def start(run_dir: Path, engine: str, *args: str) -> subprocess.Popen[str]:
    """A 2-rank torchrun of the worker into ``run_dir``."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
        str(WORKER), "--engine", engine, "--steps", "8", *args,
    ]  # fmt: skip
    return spawn(cmd, env={"ORCHESTRATOR_RUN_DIR": str(run_dir)})


def ended(proc: subprocess.Popen[str], run_dir: Path) -> str | None:
    """What went wrong with the run ``proc`` ends, or None: exit 0, and the journal's
    ``run_end`` says finished."""
    r = wait(proc, timeout=240)
    if r.returncode != 0 or "terminate called" in r.stdout:
        return f"{run_dir}: exit {r.returncode}\n{r.stdout[-3000:]}"
    ends = [e["details"]["status"] for e in kinds(run_dir, "run_end")]
    return None if ends == ["finished"] else f"{run_dir}: run_end {ends}"


def end_runs(tmp_path: Path, engines: list[str], rounds: int, *args: str) -> list[str]:
    """``rounds`` rounds of one run per engine, the engines' runs side by side; what went
    wrong."""
    problems = []
    for i in range(rounds):
        dirs = [tmp_path / f"{engine}-{i}" for engine in engines]
        procs = [start(d, engine, *args) for d, engine in zip(dirs, engines, strict=True)]
        try:
            problems += [ended(p, d) for p, d in zip(procs, dirs, strict=True)]
        finally:  # one timed out: its neighbour goes too
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.communicate()
    return [p for p in problems if p is not None]


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "engines", [ENGINES, pytest.param(["fsdp2", "zero2"], marks=pytest.mark.matrix)], ids="+".join
)
def test_a_collective_freed_as_the_interpreter_finalizes_does_not_abort_the_run(
    tmp_path: Path, engines: list[str]
) -> None:
    """Rank 0's gloo thread frees an all-reduce's tensor while its main thread holds the GIL
    into finalization (see ending_worker.py): SIGABRT, every time, without the Guard's exit
    fence. ZeRO-2 and FSDP2 in the full matrix only (DeepSpeed starts slowly)."""
    assert end_runs(tmp_path, engines, 1, "--late-collective") == []


@pytest.mark.timeout(240)
def test_the_plain_ending_exits_0_with_the_cpu_saturated(tmp_path: Path) -> None:
    """A DDP and an FSDP1 run side by side with two busy loops: more runnable threads than
    cores, so a gloo thread can wait long for a core as its process ends."""
    with busy_loops(2):
        assert end_runs(tmp_path, ENGINES, 1) == []


@pytest.mark.matrix
@pytest.mark.timeout(2400)
def test_twenty_plain_endings_per_engine_with_the_cpu_saturated_all_exit_0(
    tmp_path: Path,
) -> None:
    with busy_loops(3):
        failed = end_runs(tmp_path, ENGINES, 20)
    assert not failed, f"{len(failed)} of 40 runs did not end cleanly:\n" + "\n".join(failed)
