"""The base of every error commsched raises: ``except commsched.CommschedError`` catches
them all. Each error also keeps the standard base that says what kind of failure it is
(a ``ConfigError`` is a ``ValueError``, a ``SchedulerError`` a ``RuntimeError``)."""

__all__ = ["CommschedError", "SchedulerError"]


class CommschedError(Exception):
    """Whatever commsched raised."""


class SchedulerError(CommschedError, RuntimeError):
    """A request could not be scheduled, or a collective it ran failed."""
