"""Signal handling shared by the long-running commands."""

from __future__ import annotations

import asyncio
import signal
import sys

__all__ = ["exit_on_sigterm", "sigterm_seen"]

_seen = False


def exit_on_sigterm() -> None:
    """Make SIGTERM stop the process through ``finally`` blocks (child cleanup).

    Outside the event loop it raises ``SystemExit(0)``. While uvicorn serves, its
    own handler takes the signal and shuts down; uvicorn then raises the signal
    again, which this handler notes and otherwise ignores because the loop is still
    running, so the server returns normally and the callers' cleanup runs. A signal
    that comes while the loop runs but before uvicorn took the signals over is noted
    the same way: the server reads :func:`sigterm_seen` once it has started.
    """

    def handler(signum: int, frame: object) -> None:
        global _seen
        _seen = True
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            sys.exit(0)

    signal.signal(signal.SIGTERM, handler)


def sigterm_seen() -> bool:
    """Whether SIGTERM came since :func:`exit_on_sigterm` (a server that started after
    it must stop at once)."""
    return _seen
