"""Telemetry tests (a package, so that module names cannot collide with other test folders)."""
