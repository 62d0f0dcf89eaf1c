"""Host syncs of a healthy step, counted on CPU: the check's ``.tolist()`` is the one the
design allows (orchestrator/check.py). Every Python-level read of a tensor's value
(``item``, ``tolist``, ``float()``, ``int()``, ``bool()``) the training thread makes inside
``guard.backward`` / ``guard.step`` is counted, with where it was made; on a GPU each is a
host sync (tests/gpu/ counts them there with ``torch.cuda.set_sync_debug_mode``)."""

from __future__ import annotations

import threading
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from inproc import Regression

from orchestrator import Guard, parse_policy

pytestmark = pytest.mark.timeout(120)

READS = ("item", "tolist", "__float__", "__int__", "__bool__")


class Reads:
    """Counts value reads by the training thread while ``armed``, by method and by the
    innermost orchestrator/ or torch/ frame that made them."""

    def __init__(self) -> None:
        self.armed = False
        self.calls: Counter[str] = Counter()
        self.where: Counter[str] = Counter()
        self._thread = threading.get_ident()

    def wrap(self, name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def counted(t: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if self.armed and threading.get_ident() == self._thread:
                self.calls[name] += 1
                frames = [
                    f"{f.filename.split('/site-packages/')[-1]}:{f.lineno}"
                    for f in traceback.extract_stack()[:-1]
                    if "/orchestrator/" in f.filename or "/torch/" in f.filename
                ]
                self.where[f"{name} at {frames[-1] if frames else '?'}"] += 1
            return real(t, *args, **kwargs)

        return counted


@contextmanager
def counting() -> Iterator[Reads]:
    reads = Reads()
    saved = {n: getattr(torch.Tensor, n) for n in READS}
    try:
        for name, real in saved.items():
            setattr(torch.Tensor, name, reads.wrap(name, real))
        yield reads
    finally:
        for name, real in saved.items():
            setattr(torch.Tensor, name, real)


@pytest.mark.parametrize("scaled", [False, True], ids=["fp32", "grad-scaler"])
def test_a_healthy_step_reads_one_tensor_to_the_host(tmp_path: Path, scaled: bool) -> None:
    """Steps 3-12 of a healthy run, the update ratio measured at every step (the heaviest
    metrics setting), with and without a plain GradScaler and a non-fused (foreach)
    optimizer: exactly one ``.tolist()`` per step, nothing else."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    # SGD: Adam's step counter is a CPU tensor read with .item() (not a device sync on a
    # GPU, but indistinguishable from one here).
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9, foreach=True)
    scaler = torch.amp.GradScaler("cpu") if scaled else None
    policy = {
        "persist": {"enabled": False},
        "snapshot": {"every_steps": 1000},  # snapshots are not what is counted here
        "metrics": {"update_ratio_every": 1, "every_steps": 1},
    }
    guard = Guard(
        parse_policy(policy), model=model, optimizer=opt, scaler=scaler, run_dir=str(tmp_path)
    )
    loader = guard.dataloader(Regression(), batch_size=8, seed=1)
    steps = 0
    outcomes = []
    with counting() as reads:
        for x, y in guard.batches(loader, max_steps=13):
            loss = torch.nn.functional.mse_loss(model(x).squeeze(-1), y)
            reads.armed = guard.global_step >= 3
            guard.backward(loss)
            outcomes.append(guard.step())
            steps += reads.armed
            reads.armed = False
    guard.close()
    assert outcomes == ["commit"] * 13
    assert steps == 10
    assert dict(reads.calls) == {"tolist": steps}, reads.where.most_common()
    (where,) = reads.where
    assert "orchestrator/check.py" in where
    ratios = [r.get("update_ratio") for r in map(_json, (tmp_path / "metrics.jsonl").open())]
    assert len(ratios) == 13 and all(r is not None and 0 < r < 1 for r in ratios)


def _json(line: str) -> dict[str, Any]:
    import json

    out: dict[str, Any] = json.loads(line)
    return out


def test_an_overflow_step_reads_the_loss_scale_once(tmp_path: Path) -> None:
    """A GradScaler's overflow skip (a NaN gradient at step 5, metrics every step): the
    check reads the scale for ``detect.overflow.min_loss_scale`` and the metrics row
    reuses it. On an H200 the metrics row read it a second time (two syncs, not one)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9, foreach=True)
    policy = {
        "persist": {"enabled": False},
        "snapshot": {"every_steps": 1000},
        "metrics": {"every_steps": 1},
        "faults": [{"kind": "nan_grad", "step": 5}],
    }
    guard = Guard(
        parse_policy(policy),
        model=model,
        optimizer=opt,
        scaler=torch.amp.GradScaler("cpu"),
        run_dir=str(tmp_path),
    )
    loader = guard.dataloader(Regression(), batch_size=8, seed=1)
    outcomes = {}
    with counting() as reads:
        for x, y in guard.batches(loader, max_steps=8):
            step = guard.global_step
            loss = torch.nn.functional.mse_loss(model(x).squeeze(-1), y)
            guard.backward(loss)
            reads.armed = step == 5
            outcomes[step] = guard.step()
            reads.armed = False
    guard.close()
    assert outcomes[5] == "overflow_skip", outcomes
    # The check's .tolist() and one read of the scale (GradScaler.get_scale: .item()); the
    # row holds the scale the step overflowed at (GradScaler's initial 2**16).
    assert dict(reads.calls) == {"tolist": 1, "item": 1}, reads.where.most_common()
    rows = [_json(line) for line in (tmp_path / "metrics.jsonl").open()]
    assert [r["loss_scale"] for r in rows if r["step"] == 5] == [2.0**16]
