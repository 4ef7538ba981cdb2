"""The ``pd-orchestrator`` command line (``python -m pd_orchestrator`` too)."""

from pd_orchestrator.cli.main import main

__all__ = ["main"]
