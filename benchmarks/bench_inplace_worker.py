"""The competitors' ranks of benchmarks/bench_inplace.py: the example GPT (examples/train_gpt.py's
model, data, AdamW and batch size) trained under torchft 0.2.0 or NVRx 0.4.1's in-process
restart, written the way their documentation shows. Needs the ``bench`` extra; the test suite
never imports this file.

Every process appends JSON lines to ``$BENCH_OUT/<rank>-<pid>.jsonl``: ``start`` (the
process's creation time), ``step`` (a committed step: its number, the world it ran with),
``healed`` and ``fault`` (written just before rank 1 SIGKILLs itself at ``--fault-step``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import psutil
import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from train_gpt import SyntheticTokens, TinyGPT

VOCAB, SEQ, BATCH = 64, 32, 8  # examples/train_gpt.py's defaults


class Log:
    def __init__(self, name: str) -> None:
        path = Path(os.environ["BENCH_OUT"]) / f"{name}-{os.getpid()}.jsonl"
        self.f = open(path, "a", buffering=1)
        self.write("start", t=psutil.Process().create_time())

    def write(self, event: str, **kw: Any) -> None:
        self.f.write(json.dumps({"event": event, "t": time.time(), **kw}) + "\n")


def model_and_opt(a: argparse.Namespace) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = TinyGPT(VOCAB, SEQ, a.d_model, a.layers, heads=4)
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)


def batch_of(step: int, rank: int, data: SyntheticTokens) -> torch.Tensor:
    start = (step * 2 + rank) * BATCH % len(data)
    return torch.stack([data[(start + i) % len(data)] for i in range(BATCH)])


def loss_of(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))


def _stop_at(ctl: dist.TCPStore, steps: int) -> int:
    return int(ctl.get("stop")) if ctl.check(["stop"]) else steps


def first_life() -> bool:
    return os.environ.get("BENCH_LIFE", "0") == "0"


# ---------------------------------------------------------------------------- torchft
def torchft_main(a: argparse.Namespace) -> None:
    """One replica group of one rank: torchft's DDP example (Manager, its DDP and Optimizer
    wrappers, gloo), healing a restarted replica from the live one over HTTP."""
    from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo

    gid = int(os.environ["REPLICA_GROUP_ID"])
    log = Log(f"replica{gid}")
    model, opt = model_and_opt(a)

    def load_state_dict(sd: dict[str, Any]) -> None:
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optim"])
        log.write("healed")

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": opt.state_dict()}

    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=10)),
        min_replica_size=1,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        replica_id=f"bench_{gid}",
        timeout=timedelta(seconds=10),
    )
    ddp = DistributedDataParallel(manager, model)
    optimizer = Optimizer(manager, opt)
    data = SyntheticTokens(1024, SEQ, VOCAB)
    # The parent's store: both replicas start together (else the first forms a quorum of
    # one), and both stop at the step it names once training is back at full strength (the
    # survivor alone would otherwise finish before the replacement is back).
    ctl = dist.TCPStore("127.0.0.1", int(os.environ["BENCH_CTL_PORT"]), is_master=False)
    if first_life():
        ctl.add("ready", 1)
        while int(ctl.add("ready", 0)) < 2:
            time.sleep(0.01)
    seen_alone, full_after = False, 0
    while (step := manager.current_step()) < _stop_at(ctl, a.steps):
        if gid == 1 and first_life() and step == a.fault_step:
            log.write("fault", step=step)
            os.kill(os.getpid(), signal.SIGKILL)
        optimizer.zero_grad()  # starts the quorum (torchft's contract)
        loss_of(ddp, batch_of(step, gid, data)).backward()
        optimizer.step()  # steps AdamW only if every replica's all-reduce succeeded
        if manager.current_step() > step:  # committed (else a peer failed: redone)
            world = manager.num_participants()
            log.write("step", step=step, world=world)
            seen_alone |= world < 2 or not first_life()
            full_after += seen_alone and world == 2
            if full_after == 3 and not ctl.check(["stop"]):
                ctl.set("stop", str(step + 3))
    log.write("done")
    manager.shutdown(wait=False)
    os._exit(0)  # the manager's threads and gloo pairs: no orderly teardown to time


# ---------------------------------------------------------------------------- NVRx
def nvrx_main(a: argparse.Namespace) -> None:
    """NVRx's in-process restart: 3 processes, 2 active ranks and a spare. A rank's death
    restarts the wrapped function in every live process; the spare takes the dead rank's
    place (ShiftRanks, then at most 2 active) and is healed by a broadcast from rank 0, whose
    model and optimizer live outside the function (NVRx moves no state itself)."""
    from nvidia_resiliency_ext import inprocess

    log = Log(f"proc{os.environ['RANK']}")
    model, opt = model_and_opt(a)
    loss_of(model, torch.randint(VOCAB, (2, SEQ + 1))).backward()
    opt.step()  # the AdamW state exists on every process, the spare's included
    opt.zero_grad(set_to_none=True)
    progress = {"step": 0}
    fast = timedelta(milliseconds=100)
    wrapper = inprocess.Wrapper(
        store_kwargs={"port": int(os.environ["MASTER_PORT"])},
        rank_assignment=inprocess.Compose(
            inprocess.rank_assignment.MaxActiveWorldSize(2),
            inprocess.rank_assignment.ShiftRanks(),
        ),
        monitor_thread_interval=fast,
        monitor_process_interval=fast,
        heartbeat_interval=fast,
        progress_watchdog_interval=fast,
        last_call_wait=fast,
        heartbeat_timeout=timedelta(seconds=10),  # its default (30 s) is a hang's bound
        # soft/hard timeouts (no progress): NVRx's defaults, 60 and 90 s
    )
    # NVRx passes its CallWrapper to the parameter annotated with that class, read from the
    # live annotation (a string under ``from __future__ import annotations`` fails its check)
    nvrx_train.__annotations__ = {"call_wrapper": inprocess.CallWrapper}
    wrapper(nvrx_train)(a, log, model, opt, progress)
    log.write("done")
    os._exit(0)


def nvrx_train(
    a: argparse.Namespace,
    log: Log,
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    progress: dict[str, int],
    call_wrapper: Any = None,
) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    it = call_wrapper.iteration
    base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["BENCH_PG_PORT"]))
    store = dist.PrefixStore(f"pg{it}", base)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=10))  # fmt: skip
    if it > 0:  # heal: rank 0 (a survivor) sends the step, the weights, the optimizer
        step = torch.tensor([progress["step"]])
        dist.broadcast(step, 0)
        progress["step"] = int(step)
        for t in _state_tensors(model, opt):
            dist.broadcast(t, 0)
        log.write("healed", step=progress["step"])
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    data = SyntheticTokens(1024, SEQ, VOCAB)
    while progress["step"] < a.steps:
        k = progress["step"]
        if rank == 1 and it == 0 and k == a.fault_step:
            log.write("fault", step=k)
            os.kill(os.getpid(), signal.SIGKILL)
        opt.zero_grad(set_to_none=True)
        loss_of(ddp, batch_of(k, rank, data)).backward()
        opt.step()
        progress["step"] = k + 1
        log.write("step", step=k, world=world)
    dist.barrier()
    dist.destroy_process_group()


def _state_tensors(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = [p.data for p in model.parameters()]
    for st in opt.state.values():
        out += [v for v in st.values() if isinstance(v, torch.Tensor)]
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["torchft", "nvrx"])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--fault-step", type=int, default=27)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    a = p.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    (torchft_main if a.mode == "torchft" else nvrx_main)(a)


if __name__ == "__main__":
    main()
