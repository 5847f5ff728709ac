"""Reliability and safety tests: bad input, corrupt files, crashes, numerical edge cases.

Every child process these tests start has a hard timeout (harness.py); multi-process
training goes through tests/distributed.py. With ``RELIABILITY_COUNTS=1`` in the
environment the suite writes what it injected and fuzzed to ``.last_counts.json`` here.
"""
