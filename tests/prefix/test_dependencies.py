"""pyzmq and msgpack are the optional "events" extra: routing, the simulator's server
and the prefix runtime import without them until KV events are used."""

from __future__ import annotations

import subprocess
import sys

CHECK = """
import sys
import pd_orchestrator.routing, pd_orchestrator.gateway.prefix_runtime, pd_orchestrator.sim.server
import pd_orchestrator.cli
loaded = sorted(m for m in ("zmq", "msgpack") if m in sys.modules)
assert not loaded, loaded
"""


def test_routing_and_the_simulator_do_not_need_the_events_extra() -> None:
    result = subprocess.run(
        [sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
