"""Out-of-process half: the ``orchestrator`` command line and the supervisor.

Entry point: ``launch.cli:main`` (the ``orchestrator`` console script).
"""
