"""One rank of the in-place recovery check on a GPU (tests/gpu/test_gpu_inplace.py starts it
under ``orchestrator launch --nproc-per-node 2``).

Every rank trains on ``cuda:<LOCAL_RANK mod the visible devices>``: on one GPU both ranks
share it, over gloo (NCCL refuses two ranks on one device); with one GPU per rank, over
NCCL. The policy (``ORCHESTRATOR_POLICY``) carries the fault. Writes ``OUT/rank<r>.json``
(device, backend, final step), ``OUT/starts.jsonl`` (one line per process start: rank,
pid) and ``OUT/rank<r>.pt`` (the final state, on the host) for a bit-for-bit comparison.
Without CUDA it runs on CPU (a dry run of the script).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from gpu_worker import Tokens, mlp  # puts the repository on sys.path
from torch import nn

from orchestrator import Guard, load_policy


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.use_deterministic_algorithms(True)  # with CUBLAS_WORKSPACE_CONFIG (the test's)
    local, gpus = int(os.environ["LOCAL_RANK"]), torch.cuda.device_count()
    device = torch.device("cuda", local % gpus) if gpus else torch.device("cpu")  # cpu: dry run
    if gpus:
        torch.cuda.set_device(device)
    backend = "nccl" if gpus >= int(os.environ["WORLD_SIZE"]) else "gloo"
    if backend == "nccl":
        dist.init_process_group(backend, device_id=device)
    else:
        dist.init_process_group(backend)
    rank = dist.get_rank()
    with open(out / "starts.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps({"rank": rank, "pid": os.getpid()}) + "\n")
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(mlp(256, 3).to(device))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=device.type == "cuda")
    torch.manual_seed(1234 + rank)
    guard = Guard(load_policy(os.environ["ORCHESTRATOR_POLICY"]), model=model, optimizer=opt)
    loader = guard.dataloader(Tokens(4096, 256), batch_size=16, seed=0)
    for x, y in guard.batches(loader, max_steps=args.steps):
        loss = F.cross_entropy(model(x.to(device)).float(), y.to(device))
        guard.backward(loss)
        guard.step()
    guard.close()
    state = {f"model.{k}": v.cpu() for k, v in model.state_dict().items()}
    for i, s in enumerate(opt.state.values()):
        state.update({f"opt.{i}.{k}": v.cpu() for k, v in s.items() if torch.is_tensor(v)})
    torch.save(state, out / f"rank{rank}.pt")
    info = {"pid": os.getpid(), "device": str(device), "backend": backend,
            "step": guard.global_step}  # fmt: skip
    (out / f"rank{rank}.json").write_text(json.dumps(info))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
