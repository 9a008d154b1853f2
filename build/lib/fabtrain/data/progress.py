"""A small progress reporter on stderr (no dependency).

Nothing is shown for work that finishes within ``delay`` seconds (1 s).
After that, on a terminal a single line is redrawn in place at most ten
times a second; when stderr is not a terminal (a log file, ``fab``'s
captured output) a plain line is written at most every ``every`` seconds
and once at the end, so logs stay readable.
"""

from __future__ import annotations

import sys
import threading
import time


def _mib(n: float) -> str:
    return f"{n / 1048576:.0f} MiB" if n >= 10 * 1048576 else f"{n / 1048576:.1f} MiB"


class Progress:
    def __init__(self, label: str, total: int | None, *, stream=None,
                 enabled: bool = True, delay: float = 1.0, every: float = 5.0):
        self.label = label
        self.total = total
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.delay = delay
        self.every = every
        self.done = 0
        self.start = time.monotonic()
        self._last = 0.0
        self._shown = False
        self._lock = threading.Lock()
        try:
            self.tty = bool(self.stream.isatty())
        except Exception:
            self.tty = False

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        self.close(ok=exc_type is None)

    def update(self, n: int) -> None:
        if not self.enabled:
            return
        with self._lock:
            self.done += n
            now = time.monotonic()
            if now - self.start < self.delay:
                return
            if now - self._last < (0.1 if self.tty else self.every):
                return
            self._last = now
            self._draw(now, final=False)

    def _line(self, now: float) -> str:
        elapsed = max(now - self.start, 1e-9)
        rate = self.done / elapsed
        if self.total:
            frac = min(self.done / self.total, 1.0)
            width = 24
            fill = int(frac * width)
            bar = "#" * fill + "-" * (width - fill)
            return (f"prepare.py: {self.label} [{bar}] {frac * 100:5.1f}% "
                    f"{_mib(self.done)}/{_mib(self.total)} {_mib(rate)}/s")
        return f"prepare.py: {self.label} {_mib(self.done)} {_mib(rate)}/s"

    def _draw(self, now: float, final: bool) -> None:
        try:
            if self.tty:
                self.stream.write("\r\x1b[K" + self._line(now) + ("\n" if final else ""))
            else:
                self.stream.write(self._line(now) + "\n")
            self.stream.flush()
            self._shown = True
        except Exception:
            self.enabled = False

    def close(self, ok: bool = True) -> None:
        if not self.enabled:
            return
        with self._lock:
            now = time.monotonic()
            if self._shown:
                if ok:
                    self._draw(now, final=True)
                elif self.tty:
                    try:
                        self.stream.write("\n")
                        self.stream.flush()
                    except Exception:
                        pass
            self.enabled = False
