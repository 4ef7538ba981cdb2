"""Checks of the installed vLLM's source against a hook's :class:`~.versions.SourceMarkers`.

Imported only inside vLLM (it imports the vLLM modules the markers name).
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

from pd_orchestrator.vllm_plugin.policy import PluginContractError
from pd_orchestrator.vllm_plugin.versions import SourceMarkers, VLLMHook

__all__ = ["check_markers", "resolve"]


def resolve(module: str, qualname: str) -> Any:
    """The object ``module.qualname`` (``Class.method``); a contract error if absent."""
    target: Any = importlib.import_module(module)
    for part in qualname.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise PluginContractError(
                f"vLLM has no {module}.{qualname}; the cache-hit threshold plugin "
                f"does not support this vLLM build"
            ) from None
    return target


def check_markers(spec: SourceMarkers, hook: VLLMHook) -> None:
    """Raise :class:`PluginContractError` unless ``spec``'s markers appear in order."""
    source = inspect.getsource(resolve(spec.module, spec.qualname))
    position = 0
    for index, marker in enumerate(spec.markers):
        found = source.find(marker, position)
        if found < 0:
            raise PluginContractError(
                f"vLLM's {spec.qualname}() no longer contains {marker!r} where the "
                f"cache-hit threshold plugin's hook for vLLM {hook.release} expects it "
                f"(after {spec.markers[:index]!r}); the plugin does not support this "
                f"vLLM build"
            )
        position = found + len(marker)
