"""The bounded pool of private tokenizer copies behind one wrapped tokenizer (pool.py): copies
handed out in arrival order, event-loop callers first, every wait bounded by the hold deadline,
and a copy held past it replaced by a fresh one."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any


class _Waiter:
    """One blocked caller: its lock is released when a copy is handed to it."""

    __slots__ = ("lock", "tok")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.lock.acquire()
        self.tok: Any = None


def _on_event_loop() -> bool:
    return asyncio._get_running_loop() is not None


class CopyPool:
    """The private copies, handed out in arrival order (event-loop callers first), with every
    wait bounded by the hold deadline; ``owner`` is the thread holding all of them during a
    mutation."""

    def __init__(
        self, copies: list[Any], make_copy: Callable[[], Any], hold_deadline_s: float
    ) -> None:
        self.size = len(copies)
        self.make_copy = make_copy
        self.hold_deadline_s = hold_deadline_s
        self.lock = threading.Lock()
        self.free: deque[Any] = deque(copies)
        self.waiters: deque[_Waiter] = deque()
        self.loop_waiters: deque[_Waiter] = deque()
        self.held: dict[int, float] = {}  # id(copy) -> when it was handed out
        self.written_off: set[int] = set()  # held past the deadline and replaced
        self.replaced = 0
        self.owner: int | None = None
        self.mutation_lock = threading.Lock()

    def acquire(self) -> Any:
        loop = _on_event_loop()
        with self.lock:
            if self.free and not self.loop_waiters and (loop or not self.waiters):
                tok = self.free.popleft()
                self.held[id(tok)] = time.monotonic()
                return tok
            waiter = _Waiter()
            queue = self.loop_waiters if loop else self.waiters
            queue.append(waiter)
            arrived = time.monotonic()
        while True:
            with self.lock:
                oldest = min(self.held.values(), default=arrived)
            due = min(oldest, arrived) + self.hold_deadline_s
            if waiter.lock.acquire(timeout=max(0.0, due - time.monotonic())):
                return waiter.tok
            with self.lock:
                if waiter.tok is not None:  # handed over between the timeout and this lock
                    return waiter.tok
                stale = self._stale(time.monotonic())
                if stale is None and time.monotonic() < arrived + self.hold_deadline_s:
                    continue  # the copy we timed on was returned meanwhile: wait again
                queue.remove(waiter)
                if stale is None or len(self.written_off) >= self.size:
                    raise TimeoutError(
                        f"no tokenizer copy free within {self.hold_deadline_s} s "
                        f"({self.size} copies, {len(self.written_off)} written off while held)"
                    )
                del self.held[stale]
                self.written_off.add(stale)
                self.replaced += 1
            tok = self.make_copy()  # outside the lock: a deep copy holds the GIL a while
            with self.lock:
                self.held[id(tok)] = time.monotonic()
            return tok

    def _stale(self, now: float) -> int | None:
        """The copy held longest, if held past the deadline."""
        if not self.held:
            return None
        key = min(self.held, key=self.held.__getitem__)
        return key if now - self.held[key] >= self.hold_deadline_s else None

    def release(self, tok: Any) -> None:
        with self.lock:
            key = id(tok)
            if key in self.written_off:  # replaced while held: dropped
                self.written_off.discard(key)
                return
            queue = self.loop_waiters or self.waiters
            if not queue:
                self.held.pop(key, None)
                self.free.append(tok)
                return
            waiter = queue.popleft()
            waiter.tok = tok
            self.held[key] = time.monotonic()
        waiter.lock.release()

    @contextlib.contextmanager
    def all_copies(self) -> Iterator[list[Any]]:
        """Hold every copy (waiting for in-flight calls): the caller may mutate them all."""
        with self.mutation_lock:
            held: list[Any] = []
            try:
                for _ in range(self.size):
                    held.append(self.acquire())
                self.owner = threading.get_ident()
                yield held
            finally:
                self.owner = None
                for tok in held:
                    self.release(tok)
