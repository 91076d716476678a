"""Engine processes die with the worker that started them, however it dies.

A Dask worker whose driver is killed (SIGTERM from a batch system, Ctrl-C, the OOM killer) leaves
through `os._exit` (distributed's parent-death watch): no plugin teardown, no atexit hook. vLLM's
engine-core process and its compute worker, children of that worker, watch neither it nor each
other, so they kept running under init at ~70% of a core and ~4 GB each until someone SIGKILLed
them (SIGTERM did not stop them). So the first vLLM engine of a process starts a reaper: a small
process of its own session (a Ctrl-C to the terminal does not reach it) that notes the worker's
descendants every second and, once the worker is gone, stops those still running.

Run as `python -m unstable_dask.inference.reaper PID`.
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading

import psutil

__all__ = ["reap_when_gone", "watch_this_process"]

POLL_S = 1.0  # how often the descendants are listed, and at most how late the reaper notices
GRACE_S = 5.0  # after SIGTERM, before SIGKILL

_started: dict[int, subprocess.Popen] = {}  # pid watched -> its reaper
_lock = threading.Lock()


def _spared(p: psutil.Process) -> bool:
    # multiprocessing's resource tracker ignores SIGTERM and, once its last client is gone,
    # unlinks the shared memory they leaked; a SIGKILL would leave that memory behind.
    try:
        return any("resource_tracker" in part for part in p.cmdline())
    except psutil.Error:
        return True


def reap_when_gone(pid: int, poll_s: float = POLL_S, grace_s: float = GRACE_S) -> list[int]:
    """Wait for process `pid` to end, then stop the descendants it had; returns their pids."""
    try:
        watched = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return []
    me = os.getpid()
    # Every descendant ever seen, not the last listing: a listing taken just after the process
    # died finds its children already handed to init, i.e. none.
    seen: dict[int, psutil.Process] = {}
    while True:
        try:
            for p in watched.children(recursive=True):
                seen.setdefault(p.pid, p)
        except psutil.NoSuchProcess:
            break
        try:
            # A zombie has ended: its parent has just not collected it yet (and may be waiting
            # for this reaper to close the parent's pipes first).
            if watched.status() == psutil.STATUS_ZOMBIE:
                break
            watched.wait(timeout=poll_s)
            break
        except psutil.NoSuchProcess:
            break
        except psutil.TimeoutExpired:
            seen = {k: p for k, p in seen.items() if p.is_running()}  # pids may be reused later
    orphans = [p for k, p in seen.items() if k != me and p.is_running() and not _spared(p)]
    for p in orphans:
        try:
            p.terminate()  # psutil refuses if the pid now names another process
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(orphans, timeout=grace_s)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    return [p.pid for p in orphans]


def watch_this_process() -> None:
    """Start this process's reaper once (a no-op when it already has one)."""
    pid = os.getpid()
    with _lock:
        if pid in _started and _started[pid].poll() is None:
            return
        _started[pid] = subprocess.Popen(
            [sys.executable, "-m", "unstable_dask.inference.reaper", str(pid)],
            # None of the caller's streams: a caller capturing this process's output would
            # otherwise wait for the reaper to close them, i.e. for the process itself to end.
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


if __name__ == "__main__":
    reap_when_gone(int(sys.argv[1]))
