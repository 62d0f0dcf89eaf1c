"""Issue 33's prototype, the DDP part: can a survivor keep its ``DistributedDataParallel``
module across a re-formed process group, while the replacement runs an ordinary script
(``init_process_group``, ``DDP(model)``, an optimizer) from the top? Standalone.

The replacement's ``DDP(model)`` runs collectives in its constructor
(``_verify_param_shape_across_processes``, ``_sync_module_states``: torch
nn/parallel/distributed.py, under ``init_sync``) and starts from the initial bucket layout;
the survivor mirrors both on the new group: the same collectives, then a new reducer
(``_ddp_init_helper``). ``ddp._update_process_group(new_group)`` alone is not enough: it keeps
the survivor's rebuilt buckets, the first all-reduce's sizes differ, and gloo's background
thread aborts the survivor (``gloo::EnforceNotMet ... Received data size doesn't match``).
The constructor's broadcast from rank 0 heals the replacement's parameters; the optimizer's
momentum and the step follow by broadcast. Rank 1 is SIGKILLed before its backward at step 6;
every rank starts from a different random init on purpose (DDP's broadcast makes them equal).
Every rank's script calls ``init_process_group("gloo")`` (env://, torchrun's agent-store
contract); each generation's group meets in a TCPStore of its own, hosted by the parent (the
replacement's ``MASTER_PORT``); a survivor joins it with the same ``default_pg/`` key prefix.

    python benchmarks/proto_inplace_ddp.py                 # the reducer built again
    python benchmarks/proto_inplace_ddp.py --update-only   # _update_process_group alone

Prints: whether rank 0 kept its process id, whether the final parameters and momentum are bit
for bit those of a run without the fault, the seconds from the fault to the next completed
step, and the survivor's error.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import zlib
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.utils import _sync_module_states, _verify_param_shape_across_processes
from torch.nn.parallel import DistributedDataParallel as DDP

WORLD, STEPS, TIMEOUT = 2, 12, timedelta(seconds=10)


def join(store: dist.TCPStore, gen: int, rank: int) -> None:
    """The survivor's init on generation ``gen``'s store (its port in ``gen/<gen>``), with the
    key layout an env:// init builds there (``default_pg/``), so it meets the replacement's
    own ``init_process_group("gloo")``."""
    port = int(store.get(f"gen/{gen}"))
    pg_store = dist.TCPStore(os.environ["MASTER_ADDR"], port, is_master=False, timeout=TIMEOUT)
    prefixed = dist.PrefixStore("default_pg", pg_store)
    dist.init_process_group("gloo", store=prefixed, rank=rank, world_size=WORLD, timeout=TIMEOUT)


def heal(opt: torch.optim.SGD, step: int) -> int:
    """The Guard's part: the step and the momentum from rank 0 (the parameters came with
    DDP's constructor broadcast)."""
    t = torch.tensor([step])
    dist.broadcast(t, 0)
    for group in opt.param_groups:
        for p in group["params"]:
            buf = opt.state[p].setdefault("momentum_buffer", torch.zeros_like(p))
            dist.broadcast(buf, 0)
    return int(t)


def rejoin(store: dist.TCPStore, ddp: DDP, gen: int, rank: int) -> None:
    """The survivor: a new group, and DDP's reducer built again on it, as the replacement's
    ``DDP(model)`` builds its own: the same constructor collectives, and the initial bucket
    layout (a survivor's reducer holds the layout it rebuilt after its first step; the
    replacement's fresh one does not, and their first all-reduce would not match)."""
    store.wait([f"gen/{gen}"], timedelta(seconds=60))
    dist.destroy_process_group()
    join(store, gen, rank)
    group = dist.group.WORLD
    assert group is not None
    ddp.process_group = group
    params, sparse = ddp._build_params_for_reducer()
    _verify_param_shape_across_processes(group, params)
    _sync_module_states(ddp.module, group, ddp.broadcast_bucket_size, 0, set(), True)
    if os.environ.get("PROTO_UPDATE_ONLY") == "1":
        ddp._update_process_group(group)
        return
    names = ddp._build_debug_param_to_name_mapping(params)
    ddp._ddp_init_helper(params, sparse, names, False)
    ddp._has_rebuilt_buckets = False


def crc(ddp: DDP, opt: torch.optim.SGD) -> int:
    parts = [p.detach().reshape(-1) for p in ddp.module.parameters()]
    parts += [opt.state[p]["momentum_buffer"].reshape(-1) for p in ddp.module.parameters()]
    return zlib.crc32(torch.cat(parts).numpy().tobytes())


def worker(fault_step: int) -> None:
    torch.set_num_threads(1)
    rank, gen = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["PROTO_CONTROL_PORT"])
    store = dist.TCPStore(addr, port, is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", timeout=TIMEOUT)  # the "user script" from here on: env://
    torch.manual_seed(100 + rank + 10 * gen)  # different on every rank: DDP syncs them
    layers = [torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Tanh()) for _ in range(10)]
    ddp = DDP(torch.nn.Sequential(*layers))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    step = heal(opt, 0) if gen > 0 else 0
    first = gen > 0
    while step < STEPS:
        g = torch.Generator().manual_seed(step * WORLD + rank)
        x, y = torch.randn(32, 1024, generator=g), torch.randn(32, 1024, generator=g)
        try:
            loss = torch.nn.functional.mse_loss(ddp(x), y)
            if gen == 0 and rank == 1 and step == fault_step:
                store.set("t_fault", str(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
            loss.backward()
        except RuntimeError as err:
            store.set("error", f"{time.time()} {type(err).__name__}: {str(err)[:200]}")
            gen += 1
            rejoin(store, ddp, gen, rank)
            heal(opt, step)
            opt.zero_grad(set_to_none=True)
            first = True
            continue
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        if first and rank == 0:
            store.set("t_next", str(time.time()))
            first = False
    dist.barrier()
    store.set(f"final/{rank}", f"{crc(ddp, opt)} {os.getpid()}")
    dist.destroy_process_group()


def run(fault_step: int) -> dict[str, str]:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    stores = [
        store
    ]  # generation g's process group meets in stores[g] (torchrun: a new one per try)
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", PROTO_CONTROL_PORT=str(store.port))
    env.update(TORCHELASTIC_USE_AGENT_STORE="True")
    env.update(WORLD_SIZE=str(WORLD), LOCAL_WORLD_SIZE=str(WORLD), OMP_NUM_THREADS="1")
    argv = [sys.executable, __file__, "--worker", str(fault_step)]

    def start(rank: int, gen: int) -> subprocess.Popen[bytes]:
        rank_env = dict(
            env, RANK=str(rank), LOCAL_RANK=str(rank), MASTER_PORT=str(stores[gen].port)
        )
        return subprocess.Popen(argv, env=dict(rank_env, TORCHELASTIC_RESTART_COUNT=str(gen)))

    procs = {r: start(r, 0) for r in range(WORLD)}
    pid0, gen = procs[0].pid, 0
    while any(p.poll() is None for p in procs.values()):
        for r, p in procs.items():
            if p.poll() not in (None, 0):
                if r == 0 or gen > 0:  # the survivor died, or a second death: not in place
                    for q in procs.values():
                        q.kill()
                    raise SystemExit(f"rank {r} died (exit {p.poll()}): no in-place recovery")
                gen += 1
                stores.append(dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False))
                store.set(f"gen/{gen}", str(stores[gen].port))
                procs[r] = start(r, gen)
        time.sleep(0.005)
    keys = ["final/0", "final/1", "t_fault", "t_next", "error"]
    out = {k: store.get(k).decode() for k in keys if store.check([k])}
    out["pid_kept"] = str(out["final/0"].split()[1] == str(pid0))
    return out


def main() -> None:
    if sys.argv[1:2] == ["--worker"]:
        worker(int(sys.argv[2]))
        return
    if sys.argv[1:2] == ["--update-only"]:
        os.environ["PROTO_UPDATE_ONLY"] = "1"
    ref = run(-1)
    got = run(6)
    same = got["final/0"].split()[0] == got["final/1"].split()[0] == ref["final/0"].split()[0]
    print(f"rank 0 kept its pid: {got['pid_kept']}; bit for bit: {same}")
    print(f"fault -> next completed step: {float(got['t_next']) - float(got['t_fault']):.2f} s")
    print(f"survivor's error: {got.get('error', '').split(' ', 1)[-1]}")


if __name__ == "__main__":
    main()
