"""The build beside ``pyproject.toml``: pure Python, or the request path compiled.

Every build is pure Python unless ``PDO_COMPILE=1`` is set; then the modules of
:data:`COMPILED` are compiled to C extensions by mypyc (mypy must be installed in
the building environment: ``--no-build-isolation``), with the same behaviour and
about a fifth fewer instructions per request (docs/performance.md, "Eleventh
pass"). ``make compiled`` builds them into ``.compiled/``, outside the source tree,
so an edited module never runs as a stale compiled copy; ``make test`` runs the
request path's tests against that build too. The image (deploy/Dockerfile) ships it.

What a compiled module may not hold, as mypyc 2.4 compiles it:

- a ``finally`` block that awaits: after an exception was handled, a compiled
  coroutine's awaiting ``finally`` raised that exception again at its end (the
  flow's recovery tests failed so); such cleanup is written ``except BaseException:
  ...; raise`` and again after the ``try`` (``tests/deploy/test_compiled.py`` holds
  every compiled module to it);
- a pydantic model, or a record with a ``ClassVar`` (the routing plugins' and the
  policies' parameters): the class fails to build at import;
- a class the tests subclass or stand in for (the hand-over).
"""

from __future__ import annotations

import os
from typing import Any

from setuptools import setup

COMPILED = (
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
    "pd_orchestrator/gateway/response.py",
    "pd_orchestrator/model/load.py",
    "pd_orchestrator/model/route.py",
    "pd_orchestrator/planner/plan.py",
    "pd_orchestrator/policies/threshold.py",
    "pd_orchestrator/routing/profiles.py",
    "pd_orchestrator/telemetry/fast.py",
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
