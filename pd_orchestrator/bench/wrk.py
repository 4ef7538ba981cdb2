"""wrk, the C HTTP load generator, driven from Python.

:func:`lua_script` writes the Lua script that makes wrk POST one JSON body and,
when the run ends, print one parseable line::

    PDO_WRK requests=N duration_us=N p50_us=X p90_us=X p99_us=X mean_us=X max_us=X
            errors_connect=N errors_read=N errors_write=N errors_status=N errors_timeout=N

(one line; ``errors_status`` counts answers outside 2xx/3xx). :func:`wrk_command`
builds the command line, :func:`parse_output` reads that line back into a
:class:`WrkResult` (times in seconds). A streamed answer counts as done when its
last chunk has arrived, so latencies cover the whole stream.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from pd_orchestrator.model.records import record

__all__ = ["MARKER", "WrkResult", "lua_script", "parse_output", "wrk_command"]

MARKER = "PDO_WRK"
_INTEGERS = (
    "requests",
    "duration_us",
    "errors_connect",
    "errors_read",
    "errors_write",
    "errors_status",
    "errors_timeout",
)
_FLOATS = ("p50_us", "p90_us", "p99_us", "mean_us", "max_us")
_PAIR = re.compile(r"(\w+)=(\S+)")

_DONE = """
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    "%s requests=%.0f duration_us=%.0f p50_us=%.1f p90_us=%.1f p99_us=%.1f mean_us=%.1f "
    .. "max_us=%.1f errors_connect=%.0f errors_read=%.0f errors_write=%.0f errors_status=%.0f "
    .. "errors_timeout=%.0f\\n",
    marker, summary.requests, summary.duration,
    latency:percentile(50), latency:percentile(90), latency:percentile(99),
    latency.mean, latency.max,
    e.connect, e.read, e.write, e.status, e.timeout))
end
"""


@record
class WrkResult:
    """One wrk run: completed requests, wall time and latencies (seconds), errors."""

    requests: int
    duration: float
    p50: float
    p90: float
    p99: float
    mean: float
    max: float
    errors_connect: int = 0
    errors_read: int = 0
    errors_write: int = 0
    errors_status: int = 0
    errors_timeout: int = 0

    @property
    def rps(self) -> float:
        """Completed requests per second of wall time."""
        return self.requests / self.duration if self.duration > 0 else 0.0

    @property
    def errors(self) -> int:
        """Socket errors, timeouts and non-2xx/3xx answers."""
        return (
            self.errors_connect
            + self.errors_read
            + self.errors_write
            + self.errors_status
            + self.errors_timeout
        )


def _lua_string(text: str) -> str:
    """``text`` as a Lua long-bracket literal (no escaping needed inside)."""
    level = 0
    while f"]{'=' * level}]" in text:
        level += 1
    equals = "=" * level
    lead = "\n" if text.startswith("\n") else ""  # Lua drops a newline right after "[["
    return f"[{equals}[{lead}{text}]{equals}]"


def lua_script(body: str, headers: Mapping[str, str] | None = None) -> str:
    """A wrk script that POSTs ``body`` on every request and prints the result line."""
    lines = [
        f"marker = {_lua_string(MARKER)}",
        'wrk.method = "POST"',
        f"wrk.body = {_lua_string(body)}",
        'wrk.headers["Content-Type"] = "application/json"',
    ]
    for name, value in (headers or {}).items():
        lines.append(f"wrk.headers[{_lua_string(name)}] = {_lua_string(value)}")
    return "\n".join(lines) + "\n" + _DONE


def wrk_command(
    executable: str,
    url: str,
    script: str,
    *,
    connections: int,
    duration: float,
    threads: int = 1,
    timeout: float = 10.0,
) -> list[str]:
    """The wrk command line for one run (``threads`` is capped at ``connections``)."""
    if connections < 1 or threads < 1 or duration <= 0 or timeout <= 0:
        raise ValueError("connections and threads must be >= 1, duration and timeout > 0")
    return [
        executable,
        "--threads", str(min(threads, connections)),
        "--connections", str(connections),
        "--duration", f"{max(1, round(duration))}s",
        "--timeout", f"{max(1, round(timeout))}s",
        "--script", script,
        url,
    ]  # fmt: skip


def parse_output(text: str) -> WrkResult:
    """The :class:`WrkResult` of wrk's output (the script's result line).

    Raises ``ValueError`` when the line is missing or lacks a field.
    """
    line = next((ln for ln in text.splitlines() if ln.startswith(MARKER + " ")), None)
    if line is None:
        raise ValueError(f"no {MARKER} line in wrk's output:\n{text[-2000:]}")
    fields = dict(_PAIR.findall(line))
    missing = [key for key in (*_INTEGERS, *_FLOATS) if key not in fields]
    if missing:
        raise ValueError(f"wrk's result line lacks {', '.join(missing)}: {line}")
    integers = {key: int(float(fields[key])) for key in _INTEGERS}
    floats = {key: float(fields[key]) / 1e6 for key in _FLOATS}
    return WrkResult(
        requests=integers["requests"],
        duration=integers["duration_us"] / 1e6,
        p50=floats["p50_us"],
        p90=floats["p90_us"],
        p99=floats["p99_us"],
        mean=floats["mean_us"],
        max=floats["max_us"],
        errors_connect=integers["errors_connect"],
        errors_read=integers["errors_read"],
        errors_write=integers["errors_write"],
        errors_status=integers["errors_status"],
        errors_timeout=integers["errors_timeout"],
    )
