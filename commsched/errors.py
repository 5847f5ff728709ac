"""How commsched reports, in one place.

- Errors: every exception commsched raises derives from ``CommschedError`` (``except
  commsched.CommschedError`` catches them all) and keeps the standard base that says what
  kind of failure it is (a ``ConfigError`` is a ``ValueError``, a ``SchedulerError`` a
  ``RuntimeError``). The command-line tools print them as one line.
- Warnings: what was not done as asked (a setting without effect, a model left alone,
  telemetry turned off, a fallback) is ``warnings.warn`` with a ``CommschedWarning``, once
  per cause.
- Notices: what commsched did, one line on stderr from rank 0 (``commsched.notices``):
  that it is on and with which settings, where telemetry went.
"""

__all__ = ["CommschedError", "CommschedWarning", "SchedulerError"]


class CommschedError(Exception):
    """Whatever commsched raised."""


class SchedulerError(CommschedError, RuntimeError):
    """A request could not be scheduled, or a collective it ran failed."""


class CommschedWarning(UserWarning):
    """Whatever commsched warned about; each kind of warning derives from it
    (``warnings.simplefilter("error", commsched.CommschedWarning)`` selects them all)."""
