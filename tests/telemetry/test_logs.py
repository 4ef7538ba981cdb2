"""Log lines: timestamp, level, logger and the request id, as text or JSON lines."""

from __future__ import annotations

import io
import json
import logging
import re
from collections.abc import Iterator

import anyio
import pytest

from pd_orchestrator.config.observability import LoggingConfig
from pd_orchestrator.telemetry.logs import REQUEST_ID, configure_logging, with_overrides

TEXT_LINE = re.compile(
    r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z (?P<level>[A-Z]+) (?P<logger>\S+) "
    r"\[(?P<request_id>[^\]]+)\] (?P<message>.*)$"
)


@pytest.fixture
def restore_root() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for handler in list(root.handlers):
        if handler not in handlers:
            root.removeHandler(handler)
    root.setLevel(level)


def _configured(config: LoggingConfig) -> io.StringIO:
    stream = io.StringIO()
    configure_logging(config, stream)
    return stream


@pytest.mark.usefixtures("restore_root")
def test_text_lines_carry_time_level_logger_and_request_id() -> None:
    stream = _configured(LoggingConfig())
    log = logging.getLogger("pd_orchestrator.test")
    log.info("outside %d", 1)
    token = REQUEST_ID.set("req-7")
    try:
        log.warning("inside")
    finally:
        REQUEST_ID.reset(token)
    log.debug("below the level")
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2, lines
    first, second = (TEXT_LINE.match(line) for line in lines)
    assert first is not None and second is not None
    assert first["level"] == "INFO" and first["request_id"] == "-"
    assert first["message"] == "outside 1" and first["logger"] == "pd_orchestrator.test"
    assert second["level"] == "WARNING" and second["request_id"] == "req-7"


@pytest.mark.usefixtures("restore_root")
def test_json_lines_carry_fields_and_tracebacks() -> None:
    stream = _configured(LoggingConfig(format="json", level="debug"))
    log = logging.getLogger("pd_orchestrator.test")
    token = REQUEST_ID.set("req-8")
    try:
        log.debug("access", extra={"fields": {"status": 200, "route": "/v1/completions"}})
        try:
            raise ValueError("boom")
        except ValueError:
            log.exception("failed")
    finally:
        REQUEST_ID.reset(token)
    access, failed = (json.loads(line) for line in stream.getvalue().splitlines())
    assert access["level"] == "DEBUG" and access["logger"] == "pd_orchestrator.test"
    assert access["request_id"] == "req-8" and access["message"] == "access"
    assert access["status"] == 200 and access["route"] == "/v1/completions"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", access["time"])
    assert "ValueError: boom" in failed["exception"]


@pytest.mark.usefixtures("restore_root")
def test_configuring_again_replaces_the_handler() -> None:
    root = logging.getLogger()
    before = len(root.handlers)
    _configured(LoggingConfig())
    second = _configured(LoggingConfig(format="json"))
    assert len(root.handlers) == before + 1
    logging.getLogger("pd_orchestrator.test").warning("once")
    assert json.loads(second.getvalue())["message"] == "once"


@pytest.mark.anyio
@pytest.mark.usefixtures("restore_root")
async def test_each_request_task_logs_its_own_id() -> None:
    stream = _configured(LoggingConfig(format="json"))
    log = logging.getLogger("pd_orchestrator.test")

    async def serve(request_id: str) -> None:
        REQUEST_ID.set(request_id)
        await anyio.sleep(0.01)
        log.info("serving %s", request_id)

    async with anyio.create_task_group() as tg:
        for n in range(5):
            tg.start_soon(serve, f"r{n}")
    log.info("after")
    records = [json.loads(line) for line in stream.getvalue().splitlines()]
    served = [r for r in records if r["message"].startswith("serving")]
    assert {r["request_id"] for r in served} == {f"r{n}" for n in range(5)}
    assert all(r["message"] == f"serving {r['request_id']}" for r in served)
    assert "request_id" not in records[-1]  # the tasks' ids stayed in their tasks


def test_flags_override_the_config() -> None:
    config = LoggingConfig(level="warning", format="json", access_log=True)
    assert with_overrides(config, None, None) is config
    assert with_overrides(config, "debug", None) == LoggingConfig(
        level="debug", format="json", access_log=True
    )
    assert with_overrides(config, None, "text").format == "text"


@pytest.mark.parametrize(
    "argv",
    [["serve", "--config", "x.yaml"], ["up"], ["sim"], ["sidecar"]],
    ids=["serve", "up", "sim", "sidecar"],
)
def test_every_daemon_takes_the_logging_flags(argv: list[str]) -> None:
    from pd_orchestrator.cli.logs import logging_from_args
    from pd_orchestrator.cli.main import build_parser

    parser = build_parser()
    args = parser.parse_args([*argv, "--log-level", "debug", "--log-format", "json"])
    assert logging_from_args(args) == LoggingConfig(level="debug", format="json")
    defaults = parser.parse_args(argv)
    assert logging_from_args(defaults, LoggingConfig(level="error")).level == "error"
    with pytest.raises(SystemExit):
        parser.parse_args([*argv, "--log-format", "xml"])
