"""Exceptions and warnings of the telemetry package."""

from __future__ import annotations

from ..errors import CommschedError, CommschedWarning

__all__ = ["TelemetryError", "TelemetryWarning"]


class TelemetryError(CommschedError):
    """A telemetry run directory or store cannot be read. The message says which file and why;
    the ``commsched report`` / ``commsched trace`` CLIs print it without a traceback."""


class TelemetryWarning(CommschedWarning, RuntimeWarning):
    """Telemetry was disabled (unwritable directory, disk full, ...). Training goes on; the
    warning is issued once per recorder so a failing disk does not flood the log."""
