"""``--log-level`` and ``--log-format``: the logging flags every daemon command takes."""

from __future__ import annotations

import argparse
from typing import get_args

from pd_orchestrator.config.observability import LogFormat, LoggingConfig, LogLevel
from pd_orchestrator.telemetry.logs import configure_logging, with_overrides

__all__ = ["add_logging_arguments", "logging_from_args", "setup_logging"]


def add_logging_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--log-level`` and ``--log-format`` (both override the config's ``logging``)."""
    parser.add_argument(
        "--log-level",
        choices=get_args(LogLevel),
        default=None,
        help="lowest level logged (default: the config's logging.level, else info)",
    )
    parser.add_argument(
        "--log-format",
        choices=get_args(LogFormat),
        default=None,
        help="text lines or JSON lines (default: the config's logging.format, else text)",
    )


def logging_from_args(
    args: argparse.Namespace, config: LoggingConfig | None = None
) -> LoggingConfig:
    """``config`` (default: the defaults) with the command line's logging flags."""
    return with_overrides(config or LoggingConfig(), args.log_level, args.log_format)


def setup_logging(args: argparse.Namespace, config: LoggingConfig | None = None) -> LoggingConfig:
    """Configure the process's logging from ``config`` and the flags; returns what applied."""
    applied = logging_from_args(args, config)
    configure_logging(applied)
    return applied
