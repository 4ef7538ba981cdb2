"""Measured profiles: the points ``pd-orchestrator profile`` took, the latency model
fitted to them, and the file that carries both (pure: no I/O but reading and
writing that file).

The fitted model is a :class:`~pd_orchestrator.model.hardware.LatencyProfile`, the
simulator's own step model (so ``pd-orchestrator sim --profile FILE`` runs from it),
fitted in three independent least-squares fits:

* **prefill** (a lone prompt, nothing decoding): ``ttft = a_pf + n * lin + attn * n *
  (c + n / 2)`` for ``n`` new tokens after ``c`` cached ones; the cold points (``c =
  0``) and the warm ones (``c > 0``) together;
* **decode** (``B`` streams, each step ``B`` tokens): ``itl = k0 + ctx_read * S``, ``S``
  the streams' summed context, ``k0 = a_dec + weights`` (the step is bound by reading
  the weights at the batches measured); a **mixed** step (the streams' step that also
  carries a cold prompt of ``n`` tokens, beyond the weights' slack) splits ``k0``:
  ``a_dec = step - (B + n) * lin - ctx_read * S - attn * n * n / 2`` (the median
  over mixed points, within ``[0, k0]``), ``weights = k0 - a_dec``;
* **hand-over** (a prompt of ``L`` tokens prefilled on a prefiller, decoded on the
  decoder through the connector): ``seconds = fixed + per_token * L``, each sample the
  decode leg's time to its first token less the same prompt's, warm, on the decoder
  alone. ``fixed`` is the profile's ``a_kv``; ``per_token`` its ``kv_bytes_per_token /
  link_bytes_per_s``.

Every coefficient is at least 0: a fit that gives a negative one drops that term and
fits again. Each fit reads the median of the samples taken at one setting, so one
slow sample does not move it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import field
from functools import lru_cache
from pathlib import Path
from typing import Any, TypeVar

import yaml

from pd_orchestrator.model.hardware import PROFILES, LatencyProfile
from pd_orchestrator.model.records import record

__all__ = [
    "FORMAT",
    "Knowledge",
    "Measured",
    "MixedPoint",
    "Points",
    "PrefillPoint",
    "StepPoint",
    "TransferPoint",
    "dump_measured",
    "fit",
    "fit_decode",
    "fit_handover",
    "fit_prefill",
    "knowledge_for",
    "load_measured",
    "nonnegative_least_squares",
    "resolve_profile",
]

K = TypeVar("K")

FORMAT = "pd-orchestrator-profile/1"
"""The ``format`` field of a profile file."""


@record
class PrefillPoint:
    """A lone prompt's time to its first token: ``new`` tokens computed after
    ``cached`` ones."""

    new: int
    cached: int
    seconds: float


@record
class StepPoint:
    """A decode step with ``batch`` streams whose contexts sum to ``context`` tokens."""

    batch: int
    context: int
    seconds: float


@record
class MixedPoint:
    """A decode step of ``batch`` streams (contexts summing to ``context``) that also
    prefilled a cold prompt of ``chunk`` tokens."""

    batch: int
    context: int
    chunk: int
    seconds: float


@record
class TransferPoint:
    """The hand-over of a ``tokens``-token prompt: seconds it added to the decode leg's
    first token."""

    tokens: int
    seconds: float


@record
class Points:
    """The raw measurements."""

    prefill: tuple[PrefillPoint, ...] = ()
    decode: tuple[StepPoint, ...] = ()
    mixed: tuple[MixedPoint, ...] = ()
    handover: tuple[TransferPoint, ...] = ()


@record
class Measured:
    """A profile file: the fitted ``profile``, the raw ``points`` and ``source`` (what
    was measured: URLs, model, bounds, when)."""

    profile: LatencyProfile
    points: Points
    source: dict[str, Any] = field(default_factory=dict)


@record
class Knowledge:
    """What a pool's latency model starts from: ``profile`` and, in words, ``source``
    (``simulator profile NAME`` or ``measured profile FILE``)."""

    profile: LatencyProfile
    source: str


# -- fitting ---------------------------------------------------------------------------------


def _solve(rows: Sequence[Sequence[float]], ys: Sequence[float]) -> list[float] | None:
    """The least-squares solution of ``rows @ x = ys`` (normal equations, Gaussian
    elimination with partial pivoting); None when singular."""
    n = len(rows[0])
    a = [[sum(r[i] * r[j] for r in rows) for j in range(n)] for i in range(n)]
    b = [sum(r[i] * y for r, y in zip(rows, ys, strict=True)) for i in range(n)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda i: abs(a[i][col]))
        if abs(a[pivot][col]) < 1e-300:
            return None
        a[col], a[pivot] = a[pivot], a[col]
        b[col], b[pivot] = b[pivot], b[col]
        for i in range(col + 1, n):
            factor = a[i][col] / a[col][col]
            for j in range(col, n):
                a[i][j] -= factor * a[col][j]
            b[i] -= factor * b[col]
    x = [0.0] * n
    for i in reversed(range(n)):
        x[i] = (b[i] - sum(a[i][j] * x[j] for j in range(i + 1, n))) / a[i][i]
    return x


def nonnegative_least_squares(rows: Sequence[Sequence[float]], ys: Sequence[float]) -> list[float]:
    """Least squares with every coefficient >= 0: the most negative term is dropped
    (set to 0) and the rest fitted again, until none is negative."""
    active = list(range(len(rows[0])))
    while active:
        solved = _solve([[r[i] for i in active] for r in rows], ys)
        if solved is None:
            active.pop()
            continue
        worst = min(range(len(active)), key=lambda k: solved[k])
        if solved[worst] >= 0.0:
            x = [0.0] * len(rows[0])
            for k, i in enumerate(active):
                x[i] = solved[k]
            return x
        active.pop(worst)
    return [0.0] * len(rows[0])


def _medians(
    points: Iterable[Any], key: Callable[[Any], K], value: Callable[[Any], float]
) -> dict[K, float]:
    """The median ``value`` of the points of each ``key``."""
    groups: dict[K, list[float]] = {}
    for point in points:
        groups.setdefault(key(point), []).append(value(point))
    return {k: statistics.median(v) for k, v in groups.items()}


def fit_prefill(points: Iterable[PrefillPoint]) -> tuple[float, float, float]:
    """``(a_pf, lin, attn)`` of the prefill points (module docstring); zeros with none."""
    medians = _medians(points, lambda p: (p.new, p.cached), lambda p: p.seconds)
    if not medians:
        return 0.0, 0.0, 0.0
    rows = [[1.0, float(n), n * (c + n / 2)] for n, c in medians]
    a_pf, lin, attn = nonnegative_least_squares(rows, list(medians.values()))
    return a_pf, lin, attn


def fit_decode(
    steps: Iterable[StepPoint], mixed: Iterable[MixedPoint], lin: float, attn: float
) -> tuple[float, float, float]:
    """``(a_dec, weights, ctx_read)`` of the decode and mixed points (module
    docstring; ``lin`` and ``attn`` from :func:`fit_prefill`); zeros with no step."""
    medians = _medians(steps, lambda p: (p.batch, p.context), lambda p: p.seconds)
    if not medians:
        return 0.0, 0.0, 0.0
    rows = [[1.0, float(s)] for _, s in medians]
    k0, ctx_read = nonnegative_least_squares(rows, list(medians.values()))
    splits = [
        m.seconds - (m.batch + m.chunk) * lin - ctx_read * m.context - attn * m.chunk**2 / 2
        for m in mixed
    ]
    a_dec = min(max(statistics.median(splits), 0.0), k0) if splits else 0.0
    return a_dec, k0 - a_dec, ctx_read


def fit_handover(points: Iterable[TransferPoint]) -> tuple[float, float]:
    """``(fixed, per_token)`` seconds of the hand-over points; zeros with none."""
    medians = _medians(points, lambda p: p.tokens, lambda p: p.seconds)
    if not medians:
        return 0.0, 0.0
    if len(medians) == 1:
        return max(next(iter(medians.values())), 0.0), 0.0
    rows = [[1.0, float(tokens)] for tokens in medians]
    fixed, per_token = nonnegative_least_squares(rows, list(medians.values()))
    return fixed, per_token


def fit(
    points: Points,
    *,
    name: str,
    model: str,
    hardware: str = "measured",
    kv_bytes_per_token: int = 128 * 1024,
    capacity_tokens: int = 845_000,
) -> LatencyProfile:
    """The latency profile fitted to ``points`` (module docstring). With no hand-over
    point the transfer is free (``a_kv`` 0, an infinite link)."""
    a_pf, lin, attn = fit_prefill(points.prefill)
    a_dec, weights, ctx_read = fit_decode(points.decode, points.mixed, lin, attn)
    fixed, per_token = fit_handover(points.handover)
    link = kv_bytes_per_token / per_token if per_token > 0 else math.inf
    return LatencyProfile(
        name=name,
        hardware=hardware,
        model=model,
        a_pf=a_pf,
        a_dec=a_dec,
        lin=lin,
        attn=attn,
        weights=weights,
        ctx_read=ctx_read,
        kv_bytes_per_token=kv_bytes_per_token,
        capacity_tokens=capacity_tokens,
        a_kv=fixed,
        link_bytes_per_s=link,
    )


# -- the file --------------------------------------------------------------------------------


def _document(measured: Measured) -> dict[str, Any]:
    profile = dataclasses.asdict(measured.profile)
    if math.isinf(profile["link_bytes_per_s"]):
        profile["link_bytes_per_s"] = None  # JSON has no infinity
    p = measured.profile
    return {
        "format": FORMAT,
        "source": measured.source,
        "fitted": profile,
        "handover": {"fixed_s": p.a_kv, "per_token_s": p.transfer_seconds(1) - p.a_kv},
        "points": dataclasses.asdict(measured.points),
    }


def dump_measured(measured: Measured, path: Path) -> None:
    """Write ``measured`` to ``path``: YAML when its suffix is ``.yaml``/``.yml``, else
    JSON."""
    document = _document(measured)
    if path.suffix in (".yaml", ".yml"):
        path.write_text(yaml.safe_dump(document, sort_keys=False))
    else:
        path.write_text(json.dumps(document, indent=1) + "\n")


def load_measured(path: Path) -> Measured:
    """Read a profile file (:func:`dump_measured`'s, YAML or JSON); ``ValueError``
    names what is wrong with it."""
    try:
        document = yaml.safe_load(path.read_text())  # JSON is YAML
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"cannot read profile file {str(path)!r}: {exc}") from None
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        raise ValueError(f"{str(path)!r} is not a profile file (format {FORMAT})")
    try:
        fitted = dict(document["fitted"])
        if fitted.get("link_bytes_per_s") is None:
            fitted["link_bytes_per_s"] = math.inf
        profile = LatencyProfile(**fitted)
        raw = document.get("points") or {}
        points = Points(
            prefill=tuple(PrefillPoint(**p) for p in raw.get("prefill", ())),
            decode=tuple(StepPoint(**p) for p in raw.get("decode", ())),
            mixed=tuple(MixedPoint(**p) for p in raw.get("mixed", ())),
            handover=tuple(TransferPoint(**p) for p in raw.get("handover", ())),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"profile file {str(path)!r}: {exc}") from None
    return Measured(profile, points, dict(document.get("source") or {}))


@lru_cache(maxsize=64)
def _load_cached(path: str, mtime: float) -> LatencyProfile:
    return load_measured(Path(path)).profile


def resolve_profile(spec: str) -> LatencyProfile:
    """A built-in simulator profile by name, else the fitted profile of the profile file
    at path ``spec``; ``KeyError`` lists the built-in names, ``ValueError`` says what is
    wrong with a file."""
    if spec in PROFILES:
        return PROFILES[spec]
    path = Path(spec)
    if not path.is_file():
        known = ", ".join(sorted(PROFILES))
        raise KeyError(f"unknown profile {spec!r} (known: {known}, or a profile file)")
    return _load_cached(str(path.resolve()), path.stat().st_mtime)


def knowledge_for(spec: str) -> Knowledge:
    """:class:`Knowledge` of a profile named in a configuration (a built-in name: the
    simulator's; else a measured profile file): see :func:`resolve_profile`."""
    profile = resolve_profile(spec)
    words = "simulator profile" if spec in PROFILES else "measured profile"
    return Knowledge(profile, f"{words} {spec}")
