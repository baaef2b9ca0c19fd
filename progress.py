"""Progress reporting that suits where the output goes: bars on a terminal, lines in a log.

On a terminal: a tqdm bar that redraws in place. Anywhere else (CI logs, `> run.log`, a batch
scheduler's output file): plain lines, since a redrawing bar becomes thousands of carriage-return fragments
in a file. A plain line comes every `every` updates when the caller counts in units worth a line each
(train.py's --log-interval steps), at most one per `min_interval` seconds so that sub-second steps do not
flood the log, and the first update's always; otherwise one every `interval` seconds.
"""

import sys
import threading
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
        self.start = self.last_print = self.last_output = time.perf_counter()
        self.start_n = initial
        self.first_done = None  # when the first update came: the rate leaves out that first, slow unit
        self.bar = None
        if enabled and self.stream.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, desc=desc, unit=unit, dynamic_ncols=True, file=self.stream,
                            unit_scale=unit_scale)

    def reset(self, n: int) -> None:
        """Back to count n (train.py's rollback redoes steps): the rate and ETA restart from there."""
        self.n = self.start_n = n
        self.start = self.last_print = time.perf_counter()
        self.first_done = None
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
        if self.first_done is None:
            self.first_done = (time.perf_counter(), self.n)
        if self.bar is not None:
            self.bar.update(n)
            self.last_output = time.perf_counter()
            return
        now = time.perf_counter()
        if self.enabled and (self.n == self.total or self._line_due(now)):
            self.last_print = now
            self.write(self.line(now))

    def _line_due(self, now: float) -> bool:
        if self.every:  # and a run's first step always gets its line, however quick
            return self.n == self.start_n + 1 or (self.n % self.every == 0
                                                  and now - self.last_print >= self.min_interval)
        return now - self.last_print >= self.interval

    def line(self, now: float) -> str:
        """The count, the postfix, and the rate and ETA: measured from the first update on once there is a later
        one, so that a first step's compilation and warm-up do not slow the estimate for the whole run."""
        done = self.n - self.start_n
        since, at = self.first_done if self.first_done and self.n > self.first_done[1] else (self.start, self.start_n)
        rate = (self.n - at) / max(now - since, 1e-9)
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
        self.last_output = time.perf_counter()
        if self.bar is not None:
            self.bar.write(message, file=self.stream)
        else:
            print(message, file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class Heartbeat:
    """A line whenever nothing has been said for `every` seconds (last_output() is when something last was):
    a first step that compiles, a long micro-step, an eval, in a terminal or a file that would otherwise stay
    silent for minutes. A daemon thread: the long C calls (matmuls) release the GIL and Python work hands it
    over every few milliseconds, so it speaks within a second of its time. describe(quiet seconds) -> the line, or
    None when the quiet is not worth a line (what runs now has just begun)."""

    def __init__(self, every: float, describe, write, last_output):
        self.every, self.describe, self.write, self.last_output = every, describe, write, last_output
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)

    def _run(self) -> None:
        while not self.stopped.wait(min(1.0, self.every / 4)):
            quiet = time.perf_counter() - self.last_output()
            if quiet >= self.every and (line := self.describe(quiet)):
                self.write(line)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stopped.set()
        self.thread.join()
