"""The base of every error commsched raises: ``except commsched.CommschedError`` catches
them all. Each error also keeps the standard base that says what kind of failure it is
(a ``ConfigError`` is a ``ValueError``, a ``SchedulerError`` a ``RuntimeError``)."""

__all__ = ["CommschedError"]


class CommschedError(Exception):
    """Whatever commsched raised."""
