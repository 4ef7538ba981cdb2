"""Building one policy from its spec through a registry, with errors that say where.

Every failure is a :class:`PolicyConfigError` naming the location in the
``threshold:`` block (``threshold.overrides[0].policy.params.policies[1]``), the
policy instance and its type: ``threshold.policy: policy 'busy' (type
'load-adaptive'): params.rise: unknown field``. A policy nested in a composite
reports its own location, not its parent's.
"""

from __future__ import annotations

from pd_orchestrator.config.policy import PolicySpec
from pd_orchestrator.policies.base import POLICY, ThresholdPolicy
from pd_orchestrator.routing.registry import Registry, RoutingConfigError

__all__ = ["PolicyConfigError", "build_policy"]


class PolicyConfigError(RoutingConfigError):
    """A threshold policy that cannot be built; see the module docstring.

    ``profile`` holds the location, ``plugin`` the instance name, ``problem`` the
    reason and ``type_name`` the type when it differs from the name.
    """

    def __init__(self, where: str, plugin: str, problem: str, type_name: str | None = None) -> None:
        super().__init__(where, POLICY.name, plugin, problem, type_name)
        of_type = f" (type {type_name!r})" if type_name not in (None, plugin) else ""
        self.args = (f"{where}: policy {plugin!r}{of_type}: {problem}",)


def build_policy(registry: Registry, spec: PolicySpec, where: str) -> ThresholdPolicy:
    """The policy ``spec`` describes, found at ``where`` in the configuration.

    Raises :class:`PolicyConfigError` for an unknown type, invalid parameters or a
    factory that refuses them.
    """
    try:
        return registry.build(POLICY, spec.plugin_spec(), where)
    except PolicyConfigError:
        raise
    except RoutingConfigError as exc:
        raise PolicyConfigError(where, exc.plugin, exc.problem, exc.type_name) from None
