"""Waiting for what another thread does, with a deadline (shared by the unit tests of the
operator's threaded parts)."""

import time


def wait_until(fn, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if fn():
            return
        time.sleep(0.01)
    raise AssertionError("condition not reached")
