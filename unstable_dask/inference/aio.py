"""The process's asyncio event loop, on a daemon thread: vLLM's async engine, the endpoint clients
and per-game play (play/task.py) all run on it, so a game awaits its engine request or endpoint
reply while the engine batches whatever every game has pending.

Code on other threads (a Dask task, the learner) hands it coroutines with `run`. Nothing may call
`run` from the loop's own thread (it would wait on itself): engines are built before play starts.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import Any, Coroutine, Optional, TypeVar

T = TypeVar("T")

_LOOP: Optional[asyncio.AbstractEventLoop] = None
_LOCK = threading.Lock()


def loop() -> asyncio.AbstractEventLoop:
    global _LOOP
    with _LOCK:
        if _LOOP is None:
            _LOOP = asyncio.new_event_loop()
            threading.Thread(target=_LOOP.run_forever, name="unstable-dask-loop", daemon=True).start()
        return _LOOP


def submit(coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
    """Schedule `coro` on the loop; a concurrent.futures.Future of its result."""
    return asyncio.run_coroutine_threadsafe(coro, loop())


def run(coro: Coroutine[Any, Any, T]) -> T:
    """Run `coro` on the loop and wait for its result (from any thread but the loop's)."""
    return asyncio.run_coroutine_threadsafe(coro, loop()).result()
