"""Out-of-process half: the ``orchestrator`` command line (supervisor in a later release)."""

__all__ = ["main"]

from launch.cli import main
