"""Progress reporting: a tqdm bar on a terminal, periodic log lines otherwise (CI, batch jobs)."""

from __future__ import annotations

import logging
import sys
import time

from tqdm import tqdm


class Progress:
    """Counts units of work; draws a bar when stderr is a terminal, else logs every
    ``interval`` s; neither where its logger leaves out INFO (``-q``)."""

    def __init__(self, total: int, desc: str, unit: str = "it", interval: float = 10.0,
                 logger: logging.Logger | None = None) -> None:
        self.total = total
        self.desc = desc
        self.unit = unit
        self.done = 0
        self._interval = interval
        self._log = logger or logging.getLogger("vlmshard")
        self._start = time.monotonic()
        self._last_log = self._start
        self._bar = tqdm(total=total, desc=desc, unit=unit, dynamic_ncols=True) \
            if sys.stderr.isatty() and self._log.isEnabledFor(logging.INFO) else None

    def update(self, n: int) -> None:
        self.done += n
        if self._bar is not None:
            self._bar.update(n)
            return
        now = time.monotonic()
        if now - self._last_log >= self._interval:
            self._last_log = now
            self._log.info("%s: %s", self.desc, self._status(now))

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        self._log.info("%s: %s", self.desc, self._status(time.monotonic()))

    def _status(self, now: float) -> str:
        elapsed = max(now - self._start, 1e-9)
        rate = self.done / elapsed
        pct = 100.0 * self.done / self.total if self.total else 100.0
        return (f"{self.done}/{self.total} {self.unit} ({pct:.0f}%), "
                f"{rate:,.0f} {self.unit}/s, {elapsed:.1f}s elapsed")

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
