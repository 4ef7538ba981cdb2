"""Benchmark output: a rich table, a JSON result file and PNG plots.

``results.json`` holds the run's settings, one summary per strategy (times in
seconds, bytes, token counts) and, per strategy, the TTFT and ITL quantiles
(0..100) the CDF plots are drawn from. Plots (matplotlib, Agg backend, no global
pyplot state): ``ttft_cdf.png``, ``itl_cdf.png``, ``decisions.png`` (requests
served by decode vs P/D), ``kv_bytes.png`` (KV bytes moved between instances), and
after a goodput search ``attainment.png`` (SLO attainment against the rate).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rich.table import Table

from pd_orchestrator.bench.goodput import GoodputSearch, SearchSettings
from pd_orchestrator.bench.results import RunResult, Slo, Summary, percentiles

__all__ = [
    "PLOTS",
    "goodput_document",
    "goodput_table",
    "plot_attainment",
    "plot_results",
    "quantiles",
    "ratios_to_best_other",
    "summary_table",
    "void_reason",
    "write_json",
]

PLOTS = ("ttft_cdf.png", "itl_cdf.png", "decisions.png", "kv_bytes.png")


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:,.0f}" if value >= 1 else f"{value * 1e3:.1f}"


def _decisions(summary: Summary) -> str:
    return " / ".join(str(summary.decisions.get(d, 0)) for d in ("decode", "pd"))


def _thresholds(summary: Summary) -> str:
    values = (summary.threshold_p10, summary.threshold_p50, summary.threshold_p90)
    return "-" if None in values else "/".join(f"{v:.2f}" for v in values if v is not None)


def summary_table(summaries: Sequence[Summary], title: str, slo: Slo) -> Table:
    """One row per strategy; the best value of each latency/goodput column in bold."""
    caption = (
        f"times in ms; goodput: requests/s meeting {slo.describe()}; decode / pd: requests "
        "served where cached / prefilled remotely; threshold: p10/p50/p90 of the values sent"
    )
    table = Table(title=title, title_justify="left", caption=caption, caption_justify="left")
    columns = (
        "strategy", "decode / pd", "threshold", "TTFT p50", "TTFT p99", "ITL p99", "TPOT p50",
        "goodput", "SLO met", "prefill Mtok", "KV GB", "err",
    )  # fmt: skip
    for column in columns:
        table.add_column(column, justify="left" if column == "strategy" else "right")
    best = _best(summaries)
    for s in summaries:
        cells = {
            "ttft_p50": _ms(s.ttft_p50),
            "ttft_p99": _ms(s.ttft_p99),
            "itl_p99": _ms(s.itl_p99),
            "tpot_p50": _ms(s.tpot_p50),
            "goodput": f"{s.goodput:.2f}",
        }
        marked = {k: f"[bold]{v}[/]" if best.get(k) == s.strategy else v for k, v in cells.items()}
        table.add_row(
            s.strategy,
            _decisions(s),
            _thresholds(s),
            marked["ttft_p50"],
            marked["ttft_p99"],
            marked["itl_p99"],
            marked["tpot_p50"],
            marked["goodput"],
            f"{s.slo_share:.0%}",
            f"{s.prefill_tokens / 1e6:.1f}",
            f"{s.kv_bytes / 1e9:.1f}",
            str(s.errors),
        )
    return table


def _best(summaries: Sequence[Summary]) -> dict[str, str]:
    """Strategy name of the best value per column (lowest latency, highest goodput)."""
    best: dict[str, str] = {}
    for key, higher in (
        ("ttft_p50", False),
        ("ttft_p99", False),
        ("itl_p99", False),
        ("tpot_p50", False),
        ("goodput", True),
    ):
        scored = [(getattr(s, key), s.strategy) for s in summaries if getattr(s, key) is not None]
        if scored:
            pick = max(scored) if higher else min(scored)
            best[key] = pick[1]
    return best


def quantiles(values: Sequence[float]) -> list[float] | None:
    """The 0th..100th percentiles of ``values`` (101 points); None when empty."""
    if not values:
        return None
    return [p or 0.0 for p in percentiles(values, range(101))]


def _curves(result: RunResult) -> dict[str, list[float] | None]:
    ttfts = [r.ttft for r in result.records if r.ok and r.ttft is not None]
    return {"ttft": quantiles(ttfts), "itl": quantiles(result.itl_samples)}


def write_json(
    path: Path,
    settings: Mapping[str, Any],
    results: Sequence[RunResult],
    summaries: Sequence[Summary],
    goodput: Mapping[str, Any] | None = None,
) -> None:
    """Write ``results.json``: settings, summaries and CDF quantiles per strategy, and
    the goodput searches when there were any (:func:`goodput_document`)."""
    document: dict[str, Any] = {
        "settings": dict(settings),
        "strategies": [
            {**asdict(summary), "quantiles": _curves(result)}
            for result, summary in zip(results, summaries, strict=True)
        ],
    }
    if goodput is not None:
        document["goodput"] = dict(goodput)
    path.write_text(json.dumps(document, indent=2, sort_keys=False) + "\n")


def _figure() -> Any:
    """A new matplotlib figure (Agg canvas); ``RuntimeError`` when matplotlib is missing."""
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise RuntimeError("plots need matplotlib: pip install 'pd-orchestrator[bench]'") from exc
    return Figure(figsize=(7, 4.5), layout="constrained")


def plot_results(
    directory: Path, title: str, results: Sequence[RunResult], summaries: Sequence[Summary]
) -> list[Path]:
    """Draw the four PNG plots (:data:`PLOTS`) into ``directory``; returns their paths."""
    curves = [_curves(result) for result in results]
    names = [s.strategy for s in summaries]
    return [
        _cdf(directory / "ttft_cdf.png", f"{title}: TTFT", names, [c["ttft"] for c in curves], 1.0),
        _cdf(directory / "itl_cdf.png", f"{title}: ITL", names, [c["itl"] for c in curves], 1e3),
        _decision_bars(directory / "decisions.png", f"{title}: decision mix", summaries),
        _kv_bars(directory / "kv_bytes.png", f"{title}: KV bytes moved", summaries),
    ]


def _cdf(
    path: Path, title: str, names: Sequence[str], curves: Sequence[list[float] | None], unit: float
) -> Path:
    figure = _figure()
    axes = figure.add_subplot()
    for name, points in zip(names, curves, strict=True):
        if points is not None:
            axes.plot([p * unit for p in points], [q / 100 for q in range(101)], label=name)
    axes.set_xscale("log")
    axes.set_xlabel("seconds" if unit == 1.0 else "milliseconds")
    axes.set_ylabel("cumulative share")
    return _save(figure, axes, path, f"{title} CDF")


def _save(figure: Any, axes: Any, path: Path, title: str) -> Path:
    """Title, grid and legend on ``axes``; ``figure`` written to ``path``."""
    axes.set_title(title, fontsize=10)
    axes.grid(True, alpha=0.3)
    axes.legend(fontsize=8)
    figure.savefig(path, dpi=110)
    return path


def _decision_bars(path: Path, title: str, summaries: Sequence[Summary]) -> Path:
    figure = _figure()
    axes = figure.add_subplot()
    names = [s.strategy for s in summaries]
    decode = [s.decisions.get("decode", 0) for s in summaries]
    pd = [s.decisions.get("pd", 0) for s in summaries]
    axes.bar(names, decode, label="decode (served where cached)")
    axes.bar(names, pd, bottom=decode, label="pd (prefilled remotely)")
    axes.set_ylabel("requests")
    axes.set_title(title, fontsize=10)
    axes.tick_params(axis="x", labelrotation=30)
    axes.legend(fontsize=8)
    figure.savefig(path, dpi=110)
    return path


def _kv_bars(path: Path, title: str, summaries: Sequence[Summary]) -> Path:
    figure = _figure()
    axes = figure.add_subplot()
    axes.bar([s.strategy for s in summaries], [s.kv_bytes / 1e9 for s in summaries])
    axes.set_ylabel("KV moved between instances (GB)")
    axes.set_title(title, fontsize=10)
    axes.tick_params(axis="x", labelrotation=30)
    figure.savefig(path, dpi=110)
    return path


def ratios_to_best_other(values: Mapping[str, float]) -> dict[str, float | None]:
    """Each strategy's value over the best of the *other* strategies' (None when
    those are all 0 or there is no other)."""
    ratios: dict[str, float | None] = {}
    for name, value in values.items():
        others = [v for other, v in values.items() if other != name]
        best = max(others, default=0.0)
        ratios[name] = value / best if best > 0 else None
    return ratios


def void_reason(searches: Mapping[str, GoodputSearch], ceiling: float) -> str | None:
    """Why the row cannot discriminate, or None when it can: every strategy at the
    floor (goodput 0, even the lowest rate fails) or every one at the ceiling (the
    search stopped at ``ceiling`` still passing). Such a row is reported, not counted."""
    found = [search.multiplier for search in searches.values()]
    if not found:
        return None
    if all(multiplier == 0.0 for multiplier in found):
        return "void: every strategy at the floor"
    if all(multiplier >= ceiling for multiplier in found):
        return "void: every strategy at the ceiling"
    return None


def goodput_table(
    searches: Mapping[str, GoodputSearch],
    title: str,
    slo: Slo,
    goal: float,
    ceiling: float = SearchSettings().ceiling,
) -> Table:
    """One row per strategy: its goodput (the highest rate multiplier meeting the
    attainment goal), the rate served there, the ratio to the best other strategy
    and each pool's busy fraction at that rate. A void row (:func:`void_reason`)
    says so in its title and shows no ratios."""
    void = void_reason(searches, ceiling)
    caption = (
        f"goodput: the highest multiple of the workload's arrival rate at which >= {goal:.0%} "
        f"of requests meet {slo.describe()}; "
        "busy: share of the run each pool spent stepping, at that rate"
    )
    if void:
        title = f"{title} -- {void} (not counted)"
    table = Table(title=title, title_justify="left", caption=caption, caption_justify="left")
    for column in ("strategy", "goodput (x rate)", "req/s", "vs best other", "SLO met", "busy"):
        table.add_column(column, justify="left" if column in ("strategy", "busy") else "right")
    ratios = _ratios(searches, void)
    for name, found in searches.items():
        best = found.best
        ratio = ratios[name]
        busy = (
            "-" if best is None else ", ".join(f"{p} {b:.0%}" for p, b in sorted(best.busy.items()))
        )
        table.add_row(
            name,
            f"{found.multiplier:.3g}",
            "-" if best is None else f"{best.rate:.2f}",
            "-" if ratio is None else f"{ratio:.2f}x",
            "-" if best is None else f"{best.attainment:.1%}",
            busy,
        )
    return table


def _ratios(searches: Mapping[str, GoodputSearch], void: str | None) -> dict[str, float | None]:
    """Each strategy's goodput over the best other's; all None on a void row."""
    if void:
        return dict.fromkeys(searches)
    return ratios_to_best_other({n: s.multiplier for n, s in searches.items()})


def goodput_document(
    searches: Mapping[str, GoodputSearch], goal: float, ceiling: float = SearchSettings().ceiling
) -> dict[str, Any]:
    """The goodput searches as ``results.json`` holds them (``void``: the reason a
    row is not counted, or null; its ratios are null then)."""
    void = void_reason(searches, ceiling)
    ratios = _ratios(searches, void)
    return {
        "attainment_goal": goal,
        "void": void,
        "strategies": {
            name: {
                "multiplier": found.multiplier,
                "ratio_to_best_other": ratios[name],
                "probes": [asdict(probe) for probe in found.probes],
            }
            for name, found in searches.items()
        },
    }


def plot_attainment(
    path: Path, title: str, searches: Mapping[str, GoodputSearch], goal: float
) -> Path:
    """``attainment.png``: each strategy's SLO attainment against the rate multiplier."""
    figure = _figure()
    axes = figure.add_subplot()
    for name, found in searches.items():
        axes.plot(
            [p.multiplier for p in found.probes],
            [p.attainment for p in found.probes],
            marker="o",
            markersize=3,
            label=name,
        )
    axes.axhline(goal, color="grey", linestyle="--", linewidth=0.8)
    axes.set_xscale("log", base=2)
    axes.set_xlabel("arrival rate (x the workload's)")
    axes.set_ylabel("share of requests meeting the SLO")
    return _save(figure, axes, path, f"{title}: SLO attainment")
