import os

from .harness import COUNTS_ENV, COUNTS_FILE, write_counts


def pytest_sessionfinish(session, exitstatus):
    if os.environ.get(COUNTS_ENV):
        write_counts(COUNTS_FILE)
