"""The drill's report (launch/drill.py): the machine it ran on, the Markdown table of its
cells, and that table put into a README between the drill markers.
"""

from __future__ import annotations

import importlib.util
import os
import platform
import time
from pathlib import Path

from launch.drill_matrix import Cell

BEGIN, END = "<!-- drill:begin -->", "<!-- drill:end -->"


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
        "| engine | fault | expected | outcome | bit for bit | in place | fault -> next step "
        "| steps lost | data lost |\n|---|---|---|---|---|---|---|---|---|"
    )
    rows = [
        f"| {c.engine} | {c.fault}: {c.what} | {c.expected} | {c.outcome} | {c.bitwise} | "
        f"{c.in_place} | "
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
