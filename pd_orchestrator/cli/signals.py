"""Signal handling shared by the long-running commands."""

from __future__ import annotations

import asyncio
import signal
import sys

__all__ = ["exit_on_sigterm"]


def exit_on_sigterm() -> None:
    """Make SIGTERM stop the process through ``finally`` blocks (child cleanup).

    Outside the event loop it raises ``SystemExit(0)``. While uvicorn serves, its
    own handler takes the signal and shuts down; uvicorn then raises the signal
    again, which this handler ignores because the loop is still running, so the
    server returns normally and the callers' cleanup runs.
    """

    def handler(signum: int, frame: object) -> None:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            sys.exit(0)

    signal.signal(signal.SIGTERM, handler)
