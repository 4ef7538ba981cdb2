"""The registry of plugin types: build plugin instances from configuration.

A :class:`PluginType` has a name (the ``type:`` in YAML), a :class:`PluginKind`
(filter, scorer, picker; later kinds such as threshold policies are just new
``PluginKind`` values), a pydantic model of its parameters (unknown fields are
errors) and a factory ``(params, context) -> plugin``. A :class:`Registry` is a
plain object: build one (``builtin_registry()`` returns one holding the built-ins),
register more types on it and pass it to whatever builds profiles. Every error
is a :class:`RoutingConfigError` naming the profile, the plugin kind and the
instance.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Generic, TypeVar, cast

from pydantic import BaseModel, ConfigDict, ValidationError

from pd_orchestrator.config.routing import PluginSpec
from pd_orchestrator.model.records import record
from pd_orchestrator.routing.interfaces import Filter, Picker, PluginContext, Scorer

__all__ = [
    "FILTER",
    "PICKER",
    "SCORER",
    "NoParams",
    "PluginKind",
    "PluginType",
    "Registry",
    "RoutingConfigError",
]

PluginT = TypeVar("PluginT")
ParamsT = TypeVar("ParamsT", bound=BaseModel)


class RoutingConfigError(ValueError):
    """A plugin that cannot be built; the message names profile, kind and instance."""

    def __init__(
        self, profile: str, kind: str, plugin: str, problem: str, type_name: str | None = None
    ) -> None:
        of_type = f" (type {type_name!r})" if type_name not in (None, plugin) else ""
        super().__init__(f"routing profile {profile!r}, {kind} {plugin!r}{of_type}: {problem}")
        self.profile = profile
        self.kind = kind
        self.plugin = plugin
        self.problem = problem
        self.type_name = type_name


class NoParams(BaseModel):
    """Parameters of a plugin that takes none (any field is an error); a convenient
    base for parameter models, which must all forbid unknown fields."""

    model_config = ConfigDict(extra="forbid", frozen=True)


@record
class PluginKind(Generic[PluginT]):
    """A kind of plugin; the type parameter is the interface its instances provide."""

    name: str


FILTER: PluginKind[Filter] = PluginKind("filter")
SCORER: PluginKind[Scorer] = PluginKind("scorer")
PICKER: PluginKind[Picker] = PluginKind("picker")


@record
class PluginType(Generic[ParamsT, PluginT]):
    """A buildable plugin type: name, kind, parameter model and factory."""

    name: str
    kind: PluginKind[PluginT]
    params: type[ParamsT]
    factory: Callable[[ParamsT, PluginContext], PluginT]


def _describe(exc: ValidationError) -> str:
    problems = []
    for error in exc.errors():
        where = ".".join(str(part) for part in ("params", *error["loc"]))
        message = "unknown field" if error["type"] == "extra_forbidden" else error["msg"]
        problems.append(f"{where}: {message}")
    return "; ".join(problems)


class Registry:
    """Plugin types by (kind, name)."""

    def __init__(self, types: Iterable[PluginType[Any, Any]] = ()) -> None:
        self._types: dict[tuple[str, str], PluginType[Any, Any]] = {}
        for plugin_type in types:
            self.register(plugin_type)

    def register(self, plugin_type: PluginType[Any, Any]) -> None:
        """Add a type; a second type of the same kind and name is an error, and so
        is a parameter model that accepts unknown fields."""
        key = (plugin_type.kind.name, plugin_type.name)
        if key in self._types:
            raise ValueError(f"{key[0]} type {key[1]!r} is already registered")
        if plugin_type.params.model_config.get("extra") != "forbid":
            raise ValueError(f"{key[0]} type {key[1]!r}: its params model must forbid extra fields")
        self._types[key] = plugin_type

    def names(self, kind: PluginKind[Any]) -> list[str]:
        """The registered type names of ``kind``, sorted."""
        return sorted(name for k, name in self._types if k == kind.name)

    def build(self, kind: PluginKind[PluginT], spec: PluginSpec, profile: str) -> PluginT:
        """An instance of ``spec`` as a ``kind`` plugin of ``profile``.

        Raises :class:`RoutingConfigError` for an unknown type, invalid parameters
        or a factory that rejects them (``ValueError``). A :class:`RoutingConfigError`
        raised by the factory (a plugin building nested plugins) propagates as is, so
        the error names the innermost plugin rather than every enclosing one.
        """
        context = PluginContext(profile=profile, name=spec.instance_name)
        plugin_type = self._types.get((kind.name, spec.type))
        if plugin_type is None:
            raise RoutingConfigError(profile, kind.name, context.name, self._unknown(kind, spec))
        try:
            params = plugin_type.params.model_validate(spec.params)
            return cast(PluginT, plugin_type.factory(params, context))
        except RoutingConfigError:
            raise
        except ValidationError as exc:
            problem = _describe(exc)
        except ValueError as exc:
            problem = str(exc)
        raise RoutingConfigError(profile, kind.name, context.name, problem, spec.type)

    def _unknown(self, kind: PluginKind[Any], spec: PluginSpec) -> str:
        known = ", ".join(self.names(kind)) or "none"
        problem = f"unknown {kind.name} type {spec.type!r} (known: {known})"
        elsewhere = sorted(k for k, name in self._types if name == spec.type)
        if elsewhere:
            problem += f"; {spec.type!r} is a {' and a '.join(elsewhere)} type"
        return problem
