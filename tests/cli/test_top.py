"""``pd-orchestrator top``: parsing, rates, and one frame of a live gateway."""

from __future__ import annotations

import subprocess

import httpx
from rich.console import Console

from pd_orchestrator.children import python_command
from pd_orchestrator.cli.top import parse_sample, render

from ..conftest import GatewayFactory, SimFactory, gateway_config

STATUS = {
    "mode": "decode-first",
    "endpoints": [
        {"name": "d0", "pool": "p", "role": "decode", "hardware": "h200", "group": "g",
         "healthy": True, "in_flight": 2,
         "load": {"running": 3, "waiting": 1, "kv_usage": 0.5, "prefix_hit_rate": 0.75,
                  "age": 0.1}},
        {"name": "d1", "pool": "p", "role": "decode", "hardware": "h200", "group": "g",
         "healthy": False, "in_flight": 0, "load": None},
    ],
}  # fmt: skip


def _metrics(decode: int, pd: int, handbacks: int) -> str:
    return (
        "# TYPE pd_orchestrator_decisions counter\n"
        f'pd_orchestrator_decisions_total{{decision="decode"}} {decode}\n'
        f'pd_orchestrator_decisions_total{{decision="pd"}} {pd}\n'
        "# TYPE pd_orchestrator_handbacks counter\n"
        f"pd_orchestrator_handbacks_total {handbacks}\n"
        "# TYPE pd_orchestrator_threshold histogram\n"
        'pd_orchestrator_threshold_bucket{le="0.5"} 4\n'
        'pd_orchestrator_threshold_bucket{le="0.7"} 10\n'
        'pd_orchestrator_threshold_bucket{le="+Inf"} 10\n'
        "pd_orchestrator_threshold_count 10\npd_orchestrator_threshold_sum 6\n"
    )


def _text(renderable: object) -> str:
    console = Console(width=160, record=True)
    console.print(renderable)
    return console.export_text()


def test_rates_come_from_two_samples() -> None:
    before = parse_sample(10.0, STATUS, _metrics(10, 4, 1))
    now = parse_sample(12.0, STATUS, _metrics(30, 8, 3))
    assert now.decisions == {"decode": 30, "pd": 8} and now.handbacks == 3
    assert now.thresholds == {0.5: 4, 0.7: 6}
    frame = _text(render(now, before))
    rates = {}
    for line in frame.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("│").split("│")]
        if len(cells) == 3:
            rates[cells[0]] = cells[2]
    assert rates["decode"] == "10.0" and rates["pd"] == "2.0" and rates["hand-backs"] == "1.0"
    assert "75%" in frame and "DOWN" in frame and "d1" in frame


def test_once_prints_a_live_gateway(
    sim_factory: SimFactory, gateway_factory: GatewayFactory
) -> None:
    nixl = ("--profile", "instant", "--kv-connector", "nixl")
    decoder, prefiller = sim_factory(*nixl), sim_factory(*nixl)
    gateway = gateway_factory(gateway_config([decoder], [prefiller]))
    body = {"model": "sim-model", "prompt": "hello " * 30, "max_tokens": 2}
    for _ in range(2):
        assert httpx.post(gateway.url + "/v1/completions", json=body, timeout=10).status_code == 200
    result = subprocess.run(
        python_command("top", "--url", gateway.url, "--once"),
        capture_output=True, text=True, timeout=30, check=False, env={"COLUMNS": "160", "PATH": ""},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "decode-0" in result.stdout and "prefill-0" in result.stdout
    rows = {}
    for line in result.stdout.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("│").split("│")]
        if len(cells) == 3:
            rows[cells[0]] = cells[1]
    assert rows["pd"] == "1" and rows["decode"] == "1" and rows["hand-backs"] == "0"
