"""Immutable records, checked statically (ground floor).

:func:`record` makes a class a slotted dataclass that the type checker treats as
frozen (PEP 681 ``frozen_default``): assigning to a field is a ``mypy --strict``
error, which ``make lint`` (part of ``make test``) reports. At run time the class
is not frozen: a frozen dataclass sets each field in ``__init__`` through
``object.__setattr__``, which makes building one about five times dearer than a
plain one, and the gateway builds about thirty such records for every request
(``docs/performance.md``, "Fifth pass"). Equality and hashing are those of a frozen
dataclass (``unsafe_hash``: the fields' tuple), unless the class defines its own
``__hash__``.
"""

from __future__ import annotations

import dataclasses
from typing import TypeVar, dataclass_transform

__all__ = ["record"]

T = TypeVar("T")


@dataclass_transform(frozen_default=True, field_specifiers=(dataclasses.field,))
def record(cls: type[T]) -> type[T]:
    """``cls`` as a slotted dataclass, frozen to the type checker (see the module)."""
    own_hash = "__hash__" in cls.__dict__
    return dataclasses.dataclass(slots=True, unsafe_hash=not own_hash)(cls)
