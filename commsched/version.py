"""commsched's version, in a module of its own so that whatever reports it imports no more
than this."""

__version__ = "0.1.0"
