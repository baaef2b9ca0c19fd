"""Progress reporting that suits where the output goes.

On a terminal: a tqdm bar that redraws in place. Anywhere else (CI logs, `> run.log`, a batch
scheduler's output file): plain lines, since a redrawing bar becomes thousands of carriage-return fragments
in a file. A plain line comes every `every` updates when the caller counts in units worth a line each
(train.py's --log-interval steps), at most one per `min_interval` seconds so that sub-second steps do not
flood the log; otherwise one every `interval` seconds.
"""

import sys
import time


def duration(seconds: float) -> str:
    seconds = int(seconds)
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s"


class Progress:
    def __init__(self, total: int | None, desc: str, unit: str = "it", initial: int = 0, enabled: bool = True,
                 interval: float = 30.0, stream=None, unit_scale: bool = False, every: int = 0,
                 min_interval: float = 1.0):
        """total None: an open-ended count (a rate, no ETA). every: off a terminal, a line every `every`
        updates (at most one per min_interval seconds) instead of one every `interval` seconds."""
        self.stream = stream or sys.stderr
        self.total, self.desc, self.unit, self.n = total, desc, unit, initial
        self.enabled, self.interval, self.every, self.min_interval = enabled, interval, every, min_interval
        self.postfix = ""
        self.start = self.last_print = time.perf_counter()
        self.start_n = initial
        self.bar = None
        if enabled and self.stream.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, desc=desc, unit=unit, dynamic_ncols=True, file=self.stream,
                            unit_scale=unit_scale)

    def reset(self, n: int) -> None:
        """Back to count n (train.py's rollback redoes steps): the rate and ETA restart from there."""
        self.n = self.start_n = n
        self.start = self.last_print = time.perf_counter()
        if self.bar is not None:
            self.bar.reset(total=self.total)
            self.bar.update(n)

    def set_postfix(self, text: str) -> None:
        """Figures shown after the count; the bar shows them at its next redraw (tqdm limits redraws to a
        few per second, so setting them every update costs nothing)."""
        self.postfix = text
        if self.bar is not None:
            self.bar.set_postfix_str(text, refresh=False)

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.bar is not None:
            self.bar.update(n)
            return
        now = time.perf_counter()
        if self.enabled and (self.n == self.total or self._line_due(now)):
            self.last_print = now
            self.write(self.line(now))

    def _line_due(self, now: float) -> bool:
        if self.every:
            return self.n % self.every == 0 and now - self.last_print >= self.min_interval
        return now - self.last_print >= self.interval

    def line(self, now: float) -> str:
        done = self.n - self.start_n
        rate = done / max(now - self.start, 1e-9)
        parts = [f"{self.desc} {self.n:,}" + (f"/{self.total:,}" if self.total else "") + f" {self.unit}"]
        if self.postfix:
            parts.append(self.postfix)
        if done:
            eta = f", eta {duration((self.total - self.n) / rate)}" if self.total else ""
            parts.append(f"{rate:,.2f} {self.unit}/s{eta}")
        return " | ".join(parts)

    def write(self, message: str) -> None:
        """A message that does not tear the bar."""
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(message, file=self.stream)
        else:
            print(message, file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
