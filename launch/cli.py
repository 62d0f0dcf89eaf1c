"""The ``orchestrator`` command line.

The CLI is an entry point, so it (and only it) installs a log handler.
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import sys
import time
import warnings
from typing import Any

from orchestrator.errors import OrchestratorError, PolicyError
from orchestrator.policy import load_policy
from orchestrator.protocol import (
    ENV_POLICY,
    ENV_RUN_DIR,
    EXIT_LOCKED,
    POLICY_NAME,
    node_name,
)
from orchestrator.rundir import archive_run_dir

EXIT_INVALID = 2  # bad input only (a policy, a path, an argument)
EXIT_FAILED = 1  # the environment failed (a disk full, read-only or failing): not the input
# What a file system says when it, not the input, is at fault.
ENVIRONMENT_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS, errno.EFBIG})


def _validate(args: argparse.Namespace) -> int:
    try:
        policy = load_policy(args.file)
    except PolicyError as err:
        print(err, file=sys.stderr)
        return EXIT_INVALID
    print(f"ok: {args.file} is a valid policy (digest {policy.digest()})")
    return 0


def _snapshots(args: argparse.Namespace) -> int:
    from orchestrator.errors import PersistError
    from orchestrator.layout import SnapshotLayout, default_url
    from orchestrator.manifest import signing_key

    target = args.target
    url = target
    key_file = None
    policy_file = os.path.join(target, POLICY_NAME)
    if "://" not in target and os.path.isfile(policy_file):  # a run directory
        try:
            persist = load_policy(policy_file).persist
        except PolicyError as err:
            print(err, file=sys.stderr)
            return EXIT_INVALID
        url = persist.url or default_url(os.path.abspath(target))
        key_file = persist.signing_key_file
    try:
        key = signing_key(key_file)
    except PersistError as err:
        print(err, file=sys.stderr)
        return EXIT_INVALID
    layout = SnapshotLayout(url, key=key)
    if args.quick:  # listing, no tensor loaded: needs no torch
        check = layout.check_files
    else:
        from orchestrator.store import DurableStore

        check = DurableStore(url, key=key).check
    cands = layout.candidates()
    if not cands:
        print(f"no snapshots under {url}")
        return 0
    print(f"snapshots under {url} (newest first)")
    print(f"{'step':>10}  {'written (UTC)':19}  {'MB':>9}  {'ranks':>5}  status")
    for c in cands:
        m = c.manifest or {}
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(m["time"])) if "time" in m else "-"
        size = f"{m['bytes'] / 2**20:9.2f}" if "bytes" in m else f"{'-':>9}"
        why = check(c) if not args.quick or not c.committed else None
        status = "valid" if why is None else f"INVALID: {why}"
        if args.quick and c.committed:
            status = "committed (not verified: --quick)"
        print(f"{c.step:>10}  {when:19}  {size}  {m.get('world_size', '-'):>5}  {status}")
    return 0


def _launch(args: argparse.Namespace) -> int:
    from launch.lock import Locked, SupervisorLock
    from launch.supervisor import Supervisor

    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if args.nproc is not None:  # orchestrator launch --nproc-per-node N script.py args
        if not cmd:
            print(
                "orchestrator launch --nproc-per-node N needs a script: ... "
                "--nproc-per-node 2 train.py",
                file=sys.stderr,
            )
            return EXIT_INVALID
        cmd = _agent_cmd(args, cmd)
    if not cmd:
        print(
            "orchestrator launch needs a command: orchestrator launch -- torchrun ...",
            file=sys.stderr,
        )
        return EXIT_INVALID
    try:
        policy = load_policy(args.policy)
    except PolicyError as err:
        print(err, file=sys.stderr)
        return EXIT_INVALID
    run_dir = (
        args.run_dir
        or os.environ.get(ENV_RUN_DIR)
        or os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"))
    )
    lock = SupervisorLock(run_dir, node_name())
    try:
        lock.acquire()  # before --fresh moves anything: a running job's files stay put
    except Locked as err:
        print(f"orchestrator launch: {err}", file=sys.stderr)
        return EXIT_LOCKED
    try:
        if args.fresh:
            for line in archive_run_dir(run_dir, policy):
                print(f"--fresh: {line}", file=sys.stderr)
        return Supervisor(policy, run_dir, cmd).run()
    finally:
        lock.release()


_RDZV_FLAGS = ("nnodes", "node_rank", "rdzv_backend", "rdzv_endpoint", "rdzv_id", "rdzv_conf",
               "master_addr", "master_port", "local_addr")  # fmt: skip


def _agent_cmd(args: argparse.Namespace, cmd: list[str]) -> list[str]:
    """The node agent's command (orchestrator/agent.py, torchrun's options): built here as
    a command line, so the supervisor never imports torch."""
    out = [sys.executable, "-m", "orchestrator.agent", "--nproc-per-node", str(args.nproc)]
    if args.standalone:
        out.append("--standalone")
    for name in _RDZV_FLAGS:
        value = getattr(args, name)
        if value is not None:
            out += ["--" + name.replace("_", "-"), str(value)]
    return [*out, *cmd]


def _health(args: argparse.Namespace) -> int:
    """Run the health checks on a node allocation through the user's launcher."""
    import json
    import subprocess
    from pathlib import Path

    from orchestrator.protocol import EXIT_UNHEALTHY

    cmd = list(args.cmd[1:] if args.cmd and args.cmd[0] == "--" else args.cmd)
    if not cmd:
        print(
            "orchestrator health needs a launcher: orchestrator health -- torchrun "
            "--nproc-per-node 8",
            file=sys.stderr,
        )
        return EXIT_INVALID
    try:
        load_policy(args.policy)  # fail here, once, on a bad policy
    except PolicyError as err:
        print(err, file=sys.stderr)
        return EXIT_INVALID
    run_dir = os.path.abspath(
        args.run_dir or os.path.join("runs", time.strftime("health-%Y%m%d-%H%M%S"))
    )
    os.makedirs(run_dir, exist_ok=True)
    env = {**os.environ, ENV_RUN_DIR: run_dir}
    if args.policy:
        env[ENV_POLICY] = os.path.abspath(args.policy)
    worker = str(Path(__file__).resolve().parent / "health_worker.py")
    code = subprocess.run([*cmd, worker], env=env).returncode
    report = os.path.join(run_dir, "health.json")
    if not os.path.exists(report):
        print(f"no health report in {run_dir} (launcher exit code {code})", file=sys.stderr)
        return code or EXIT_UNHEALTHY
    with open(report, encoding="utf-8") as f:
        doc = json.load(f)
    if doc["healthy"]:
        print(f"healthy ({doc['seconds']} s); report: {report}")
        return 0
    bad = ", ".join(
        f"rank {r} on {doc['hosts'].get(r, '?')}: {', '.join(c)}"
        for r, c in doc["bad_ranks"].items()
    )
    print(f"UNHEALTHY: {bad}; report: {report}", file=sys.stderr)
    return EXIT_UNHEALTHY


def _status(args: argparse.Namespace) -> int:
    from launch.status import follow, render

    if not os.path.isdir(args.run_dir):
        print(f"{args.run_dir}: no such run directory", file=sys.stderr)
        return EXIT_INVALID
    if args.follow:
        return follow(args.run_dir, args.interval, args.all)
    print(render(args.run_dir, args.all))
    return 0


def _report(args: argparse.Namespace) -> int:
    from launch.report import write_report

    if not os.path.isdir(args.run_dir):
        print(f"{args.run_dir}: no such run directory", file=sys.stderr)
        return EXIT_INVALID
    md, png = write_report(args.run_dir, args.out)
    print(f"wrote {md}" + (f" and {png}" if png else ""))
    if png is None:
        print("no plot: see the note at the top of the report (pip install -e '.[report]' "
              "for matplotlib)")  # fmt: skip
    return 0


def _demo(args: argparse.Namespace) -> int:
    from launch.demo import run_demo

    return run_demo(args.run_dir, args.steps)


def _positive(kind: type) -> Any:
    """An argparse type: a number of ``kind`` above zero (and finite)."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not 0 < value < float("inf"):
            raise argparse.ArgumentTypeError(f"{text!r}: must be above 0")
        return value

    parse.__name__ = kind.__name__
    return parse


def _drill(args: argparse.Namespace) -> int:
    from launch.drill import run_drill

    return run_drill(
        args.out, args.quick, args.engines, args.faults, args.policy, args.nproc, args.steps,
        args.readme,
    )  # fmt: skip


def _add_launch(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    la = sub.add_parser(
        "launch",
        help="run a training command under the supervisor (restarts, hangs, preemption)",
        description="orchestrator launch [--policy P] [--run-dir D] -- torchrun|deepspeed|"
        "python|srun ARGS...   or   orchestrator launch --nproc-per-node N script.py ARGS...",
    )
    la.add_argument("--policy", help="policy YAML (default: $ORCHESTRATOR_POLICY or defaults)")
    la.add_argument("--run-dir", help="default: $ORCHESTRATOR_RUN_DIR or ./runs/<time>")
    la.add_argument(
        "--nproc-per-node",
        "--nproc",
        dest="nproc",
        type=_positive(int),
        help="ranks per node, started by the node agent (python -m orchestrator.agent: "
        "torchrun's environment, a dead rank replaced alone); the options below as torchrun's",
    )
    la.add_argument("--standalone", action="store_true")
    for name in _RDZV_FLAGS:
        la.add_argument("--" + name.replace("_", "-"), help=argparse.SUPPRESS)
    la.add_argument(
        "--fresh",
        action="store_true",
        help="start a new run in a used run directory: its files move to archive/<time>/",
    )
    la.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD ARGS...")
    la.set_defaults(func=_launch)


def _add_health(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    he = sub.add_parser(
        "health",
        help="pre-flight health checks of a node allocation; exit 72 if a rank fails",
        description="orchestrator health [--policy P] [--run-dir D] -- torchrun "
        "--nproc-per-node N   (the launcher without a script: the checks are appended)",
    )
    he.add_argument("--policy", help="policy YAML (its health section; faults for drills)")
    he.add_argument("--run-dir", help="where health.json goes (default: ./runs/health-<time>)")
    he.add_argument("cmd", nargs=argparse.REMAINDER, help="-- LAUNCHER ARGS...")
    he.set_defaults(func=_health)


def _add_drill(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    dr = sub.add_parser(
        "drill",
        help="every fault on every engine, judged against clean runs: a table (exit 1 if a "
        "cell fails)",
        description="Runs the example model under the supervisor once per engine x fault, "
        "each in its own run directory under --out, and writes drill.md and drill.json there.",
    )
    dr.add_argument("--quick", action="store_true", help="DDP and seven faults (a few minutes)")
    dr.add_argument("--engines", help="comma-separated: ddp,fsdp2,fsdp1,zero1,zero2,zero3")
    dr.add_argument("--faults", help="comma-separated fault names (default: all)")
    dr.add_argument("--out", help="folder for the cells and the table (default: ./drill-<time>)")
    dr.add_argument("--policy", help="base policy: your storage, key and retries are drilled")
    dr.add_argument("--nproc", type=_positive(int), default=2, help="ranks per run")
    dr.add_argument("--steps", type=_positive(int), default=40, help="steps per run (>= 30)")
    dr.add_argument("--readme", help="also put the table between the drill markers of this file")
    dr.set_defaults(func=_drill)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="orchestrator",
        description="Checkpoint-and-rollback orchestrator for PyTorch training.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    v = sub.add_parser("validate", help="check a policy YAML file; exit 2 if invalid")
    v.add_argument("file", help="path of the policy YAML")
    v.set_defaults(func=_validate)
    sn = sub.add_parser(
        "snapshots", help="list durable snapshots (step, time, size, valid or why not)"
    )
    sn.add_argument("target", help="a run directory, or the fsspec URL of a snapshot store")
    sn.add_argument("--quick", action="store_true", help="skip checksums and loading")
    sn.set_defaults(func=_snapshots)
    _add_launch(sub)
    _add_health(sub)
    st = sub.add_parser("status", help="one screen on a run: attempts, ranks, incidents")
    st.add_argument("run_dir")
    st.add_argument("--follow", action="store_true", help="refresh in place until the run ends")
    st.add_argument(
        "--interval", type=_positive(float), default=2.0, help="seconds between refreshes"
    )
    st.add_argument(
        "--all",
        action="store_true",
        help="a line for every node and rank (by default many are summed up, and only "
        "those that need a look are listed)",
    )
    st.set_defaults(func=_status)
    rp = sub.add_parser(
        "report", help="report.md (timeline, totals, quarantine) and report.png of a run"
    )
    rp.add_argument("run_dir")
    rp.add_argument("--out", help="directory for the report (default: the run directory)")
    rp.set_defaults(func=_report)
    _add_drill(sub)
    de = sub.add_parser(
        "demo", help="2 CPU ranks under the supervisor: a NaN and a crash, recovered"
    )
    de.add_argument("--run-dir", help="default: ./runs/demo-<time>")
    de.add_argument("--steps", type=_positive(int), default=120)
    de.set_defaults(func=_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    # The entry point, so the one place that installs a log handler: the supervisor's
    # messages go to stderr, apart from the training output it relays to stdout.
    logging.basicConfig(level=logging.INFO, format="[orchestrator] %(message)s", stream=sys.stderr)
    # DCP warns on every single-process load; this command does that on purpose.
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except OSError as err:
        print(f"orchestrator {args.command}: {err}", file=sys.stderr)
        if err.errno in ENVIRONMENT_ERRNOS:  # a full or failing disk is not bad input
            print(
                "the file system failed, not the input: free space or fix the disk (or use "
                "another directory), then run the same command again",
                file=sys.stderr,
            )
            return EXIT_FAILED
        return EXIT_INVALID  # a path that is not there, not a directory, not ours
    except (OrchestratorError, ValueError) as err:  # what bad input raises
        print(f"orchestrator {args.command}: {err}", file=sys.stderr)
        return EXIT_INVALID


if __name__ == "__main__":
    sys.exit(main())
