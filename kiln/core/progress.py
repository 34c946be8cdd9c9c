"""Live progress of long work on stderr: the stage, counters such as regions searched n/N, kernels
compiled n/N and candidates timed n/N, and the time elapsed, as one line that tqdm redraws.

`with progress("compile model", enabled)` shows it from 2 s on (shorter work prints nothing),
redrawn twice a second while the work runs; `enabled=None` shows it when stderr is a terminal,
or as KILN_PROGRESS says (1: always, 0: never). The stages report through `stage(name)` and `count(name, done, total)`, which do
nothing when no progress is shown, so library code calls them unconditionally. One progress is
shown at a time per process; work on other threads (a fan-out's) reports into it too.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from typing import Iterator, Optional

DELAY_S = 2.0  # work shorter than this shows nothing
REDRAW_S = 0.5

_lock = threading.Lock()
_active: Optional["Progress"] = None


class Progress:
    def __init__(self, what: str, stream=None):
        self.what = what
        self.stream = stream or sys.stderr
        self.t0 = time.monotonic()
        self.section = ""
        self.stage = ""
        self.counts: dict[str, tuple[int, int]] = {}
        self._bar = None  # made when the work has taken DELAY_S
        self._stop = threading.Event()
        self._ticker = threading.Thread(target=self._tick, name="kiln-progress", daemon=True)
        self._ticker.start()

    def line(self) -> str:
        where = " · ".join(p for p in (self.section, self.stage) if p)
        parts = [f"{self.what}: {where}" if where else self.what]
        parts += [f"{name} {done}/{total}" for name, (done, total) in self.counts.items()]
        parts.append(f"{time.monotonic() - self.t0:.0f} s")
        return " · ".join(parts)

    def _tick(self) -> None:
        while not self._stop.wait(REDRAW_S):
            if time.monotonic() - self.t0 < DELAY_S:
                continue
            with _lock:
                if self._bar is None:
                    from tqdm import tqdm

                    self._bar = tqdm(total=None, bar_format="{desc}", file=self.stream, dynamic_ncols=True)
                self._bar.set_description_str(self.line(), refresh=True)

    def close(self, done: str) -> None:
        self._stop.set()
        self._ticker.join()
        with _lock:
            if self._bar is not None:  # shown: its last line stays, saying how it ended
                self.stage = done
                self._bar.set_description_str(self.line(), refresh=True)
                self._bar.close()


@contextlib.contextmanager
def progress(what: str, enabled: Optional[bool] = None, stream=None) -> Iterator[Optional[Progress]]:
    """Show progress for the work in the block (see the module's text); None while another is
    shown, or when not enabled."""
    global _active
    stream = stream or sys.stderr
    if enabled is None:
        env = os.environ.get("KILN_PROGRESS", "")
        enabled = env == "1" if env in ("0", "1") else hasattr(stream, "isatty") and stream.isatty()
    with _lock:
        if not enabled or _active is not None:
            p = None
        else:
            p = _active = Progress(what, stream)
    if p is None:
        yield None
        return
    ok = False
    try:
        yield p
        ok = True
    finally:
        with _lock:
            _active = None
        p.close("done" if ok else "failed")


def section(name: str) -> None:
    """The shown progress's work is now part `name` of the whole (a causal LM's prefill program)."""
    with _lock:
        if _active is not None:
            _active.section = name
            _active.stage = ""
            _active.counts.clear()


def stage(name: str) -> None:
    """The shown progress's stage is now `name` (its counters start again)."""
    with _lock:
        if _active is not None:
            _active.stage = name
            _active.counts.clear()


def count(name: str, done: int, total: int) -> None:
    """The shown progress's counter `name` is at done of total."""
    with _lock:
        if _active is not None:
            _active.counts[name] = (done, total)
