"""The ``orchestrator`` command line.

The CLI is an entry point, so it (and only it) installs a log handler.
"""

from __future__ import annotations

import argparse
import sys

from orchestrator.errors import PolicyError
from orchestrator.policy import load_policy

EXIT_INVALID = 2


def _validate(args: argparse.Namespace) -> int:
    try:
        policy = load_policy(args.file)
    except PolicyError as err:
        print(err, file=sys.stderr)
        return EXIT_INVALID
    print(f"ok: {args.file} is a valid policy (digest {policy.digest()})")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="orchestrator",
        description="Checkpoint-and-rollback orchestrator for PyTorch training.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    v = sub.add_parser("validate", help="check a policy YAML file; exit 2 if invalid")
    v.add_argument("file", help="path of the policy YAML")
    v.set_defaults(func=_validate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
