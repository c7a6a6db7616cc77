"""Polling for what another process does (a checkpoint written, a process gone) without counting the polls.

The suite counts the assertions it executes (``tests/conftest.py``) and ``.ci/run`` compares the count with the last
recorded run. An ``assert`` inside a polling loop counted once per poll, so three fault tests added 0 to 600 to the
count depending on how fast their processes ran (23,682 to 24,270 executed at one commit). :func:`wait_until` fails
the same way such a loop did, but its polls are not assertions; the test asserts what it waited for once after it.
"""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(done: Callable[[], object], deadline: float, *, gone: Callable[[], object] = lambda: False,
               detail: Callable[[], str] = lambda: "", interval: float = 0.05, what: str = "the condition") -> None:
    """Poll ``done()`` every ``interval`` seconds until it is true. Raises ``AssertionError`` at once when ``gone()``
    is true (what was to make it happen has ended: a process exited), or when ``time.monotonic()`` passes
    ``deadline``; the message names ``what`` and ends with ``detail()`` (the process's output, say)."""
    while not done():
        ended = gone()
        if ended or time.monotonic() >= deadline:
            why = "what was to make it happen ended" if ended else "the deadline passed"
            raise AssertionError(f"{what}: {why}. {detail()}".rstrip())
        time.sleep(interval)
