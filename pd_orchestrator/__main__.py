"""`python -m pd_orchestrator` runs the command-line interface."""

from pd_orchestrator.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
