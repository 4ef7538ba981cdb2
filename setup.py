"""The build beside ``pyproject.toml``: pure Python, or the request path compiled.

Every build is pure Python unless ``PDO_COMPILE=1`` is set; then the modules of
:data:`COMPILED` are compiled to C extensions by mypyc (mypy must be installed in
the building environment: ``--no-build-isolation``), with the same behaviour and
about 0.7x the instructions of a request (docs/performance.md, "Eleventh pass"
and "Twelfth pass"). ``make compiled`` builds them into ``.compiled/``, outside the source tree,
so an edited module never runs as a stale compiled copy; ``make test`` runs the
request path's tests against that build too. The image (deploy/Dockerfile) ships it.

What a compiled module may not hold, as mypyc 2.4 compiles it:

- a ``finally`` block that awaits: after an exception was handled, a compiled
  coroutine's awaiting ``finally`` raised that exception again at its end (the
  flow's recovery tests failed so); such cleanup is written ``except BaseException:
  ...; raise`` and again after the ``try`` (``tests/deploy/test_compiled.py`` holds
  every compiled module to it);
- a pydantic model, or a record with a ``ClassVar``: the class fails to build at
  import (the routing plugins' parameters live in ``routing/plugin_params.py``, and
  a filter's ``trusted`` is a property; ``goodput`` and its model stay pure);
- an async generator (mypyc builds none: the upstream's test transport lives apart,
  in ``upstream/mock.py``), or a ``del`` of an attribute the class does not name in
  ``__deletable__``;
- a subclass of a builtin type other than ``object`` and ``Exception``
  (``RuntimeError``: the routing's ``PluginContractError`` lives in
  ``routing/interfaces.py``), or a ``runtime_checkable`` protocol
  (``gateway/prefix_runtime.py`` stays pure);
- exceptions whose subclasses take class-level defaults (``upstream/errors.py``:
  compiled, a subclass lost its ``outcome``);
- a class the tests subclass or stand in for (the hand-over). A test that patches a
  compiled class's method is marked ``source_only`` and runs on the source only.
"""

from __future__ import annotations

import os
from typing import Any

from setuptools import setup

COMPILED = (
    "pd_orchestrator/fleet/cache_reports.py",
    "pd_orchestrator/fleet/outliers.py",
    "pd_orchestrator/fleet/scraper.py",
    "pd_orchestrator/fleet/state.py",
    "pd_orchestrator/flows/attempts.py",
    "pd_orchestrator/flows/bodies.py",
    "pd_orchestrator/flows/chunks.py",
    "pd_orchestrator/flows/flow.py",
    "pd_orchestrator/flows/legs.py",
    "pd_orchestrator/flows/machine.py",
    "pd_orchestrator/flows/render.py",
    "pd_orchestrator/flows/request.py",
    "pd_orchestrator/flows/transcript.py",
    "pd_orchestrator/gateway/admission.py",
    "pd_orchestrator/gateway/completion.py",
    "pd_orchestrator/gateway/limits.py",
    "pd_orchestrator/gateway/protocol.py",
    "pd_orchestrator/gateway/response.py",
    "pd_orchestrator/model/load.py",
    "pd_orchestrator/model/route.py",
    "pd_orchestrator/openai/responses.py",
    "pd_orchestrator/planner/plan.py",
    "pd_orchestrator/policies/estimator.py",
    "pd_orchestrator/policies/threshold.py",
    "pd_orchestrator/routing/engine.py",
    "pd_orchestrator/routing/filters.py",
    "pd_orchestrator/routing/pickers.py",
    "pd_orchestrator/routing/profiles.py",
    "pd_orchestrator/routing/scorers.py",
    "pd_orchestrator/routing/types.py",
    "pd_orchestrator/telemetry/fast.py",
    "pd_orchestrator/telemetry/metrics.py",
    "pd_orchestrator/upstream/client.py",
    "pd_orchestrator/upstream/transport.py",
)
"""The modules compiled with ``PDO_COMPILE=1``: the request path's, each ``mypy
--strict`` clean and within the rules of the module docstring."""


def ext_modules() -> list[Any]:
    """The compiled modules' extensions when ``PDO_COMPILE`` is ``1``; else none."""
    if os.environ.get("PDO_COMPILE") != "1":
        return []
    from mypyc.build import mypycify

    return list(mypycify(list(COMPILED), opt_level="3"))


if __name__ == "__main__":
    setup(ext_modules=ext_modules())
