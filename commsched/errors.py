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

__all__ = ["CommschedError", "CommschedWarning", "DataParallelError", "NotSupportedError",
           "SchedulerError", "UnavailableError", "UnsupportedError"]


class CommschedError(Exception):
    """Whatever commsched raised."""


class SchedulerError(CommschedError, RuntimeError):
    """A request could not be scheduled, or a collective it ran failed."""


class DataParallelError(CommschedError, RuntimeError):
    """The data-parallel mode refused what the training loop did; the message says how to
    change the loop."""


class UnsupportedError(CommschedError, TypeError):
    """commsched was handed an object of a kind it cannot take (an optimizer it cannot
    defer, a model already wrapped)."""


class NotSupportedError(CommschedError, NotImplementedError):
    """An operation commsched does not provide in this state (a method a subclass must
    supply, ``add_param_group`` after ``wrap``)."""


class UnavailableError(CommschedError, RuntimeError):
    """What was asked needs something this process does not have (CUDA devices, an
    initialised ``torch.distributed``)."""


class CommschedWarning(UserWarning):
    """Whatever commsched warned about; each kind of warning derives from it
    (``warnings.simplefilter("error", commsched.CommschedWarning)`` selects them all)."""
