"""Training curves from train.py's metrics.jsonl: loss, tokens/s and LR against tokens, steps or time, runs
overlaid.

    records = read_metrics(out_dir)                      # the run's records (runlog.read_metrics)
    fig = draw_runs({"run": records}, x="step")         # a matplotlib figure, one panel per PANELS name
    plot_runs({"a": a, "b": b}, "curves.png")           # ... saved

By default the per-step curves are smoothed over about 1% of their points, the raw ones faint behind them; the
loss axis leaves out the first steps' far higher losses (loss_limits), and the other axes start at 0.
report.py draws a run's curves.png with this at the run's end; bench/plot.py is the command over it, and other
benchmarks draw their own figures with it.
"""

import math
import os
import sys

import matplotlib

matplotlib.use("Agg")  # files only: no display is needed, or present on CI and servers
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import EngFormatter, LogFormatter  # noqa: E402

from atomic import replace_with  # noqa: E402
from runlog import METRICS_FILE, MetricsError, read_metrics as read_log  # noqa: E402

# Panel name -> (y-axis label, metrics keys drawn on it). "loss" shows train and val together.
PANELS = {
    "loss": ("loss", ("train_loss", "val_loss")),
    "val_loss": ("validation loss", ("val_loss",)),
    "train_loss": ("train loss", ("train_loss",)),
    "tokens_per_sec": ("tokens/s", ("tokens_per_sec",)),
    "lr": ("learning rate", ("lr",)),
}
DEFAULT_PANELS = ("loss", "tokens_per_sec", "lr")
# --x choice -> the metrics key it reads. time_s: seconds since the run started, counted across resumes.
X_KEYS = {"step": "step", "tokens": "tokens", "time": "time_s"}
# What --smooth smooths: the per-step curves, noisy from batch to batch. Not val_loss (a few points, each
# already an average over the eval tokens: smoothing would only drag them toward the past) nor lr (a schedule).
SMOOTHED_KEYS = ("train_loss", "tokens_per_sec")
# --smooth auto: an ema over about this fraction of a curve's points, so that a long run's noise does not
# hide its trend and a short run (under 1 / AUTO_SMOOTH_SPAN points) is drawn as it is.
AUTO_SMOOTH_SPAN = 0.01
# The loss axis spans the losses up to this quantile, plus LOSS_HEADROOM of that span above it: the first
# steps' losses (ln(vocab) ~ 11 for GPT-2's vocabulary) would otherwise squash the rest of the run into a line.
LOSS_QUANTILE, LOSS_HEADROOM = 0.9, 0.5


def read_metrics(out_dir: str) -> list[dict]:
    """The records of out_dir/metrics.jsonl, in file order (runlog.read_metrics: a torn last line is skipped
    with a note on stderr). MetricsError for a missing or empty file, or a damaged line."""
    path = os.path.join(out_dir, METRICS_FILE)
    if not os.path.isfile(path):
        raise MetricsError(f"{path}: no such file (is {out_dir} a train.py --out-dir?)")
    records, note = read_log(path)
    if note:
        print(note, file=sys.stderr)
    if not records:
        raise MetricsError(f"{path} has no records")
    return records


def series(records: list[dict], key: str, x: str = "tokens") -> tuple[list[float], list[float]]:
    """(x values, values) of the records that carry a number under key (val_loss is only on eval steps) and
    under the x axis' key (X_KEYS)."""
    x_key = X_KEYS[x]
    points = [(r[x_key], r[key]) for r in records
              if isinstance(r.get(key), (int, float)) and isinstance(r.get(x_key), (int, float))]
    return [t for t, _ in points], [v for _, v in points]


def check_x(records: list[dict], x: str, path: str) -> None:
    """MetricsError (one line, naming the file) when a record lacks the x axis' key: a run logged before
    train.py wrote time_s cannot be drawn against the clock."""
    x_key = X_KEYS[x]
    missing = [r for r in records if not isinstance(r.get(x_key), (int, float))]
    if missing:
        raise MetricsError(f"{path}: {len(missing)} of {len(records)} records have no {x_key} (the first at step "
                           f"{missing[0].get('step')}); use --x step or --x tokens for this run")


def ema(values: list[float], factor: float) -> list[float]:
    """Exponential moving average, debiased as TensorBoard's smoothing is: each point is the average of the
    points so far weighted by factor ** age, so the first ones are not pulled toward zero. factor 0 leaves
    the values as they are; 0.9 averages over about the last ten. A non-finite value is kept where it is
    and left out of the average, so one NaN step does not wipe out the rest of the curve."""
    out, average, weight = [], 0.0, 0.0
    for value in values:
        if not math.isfinite(value):
            out.append(value)
            continue
        average = factor * average + (1 - factor) * value
        weight = factor * weight + (1 - factor)
        out.append(average / weight)
    return out


def auto_smoothing(points: int) -> float:
    """The ema factor of --smooth auto for a curve of this many points: 1 - 1 / (AUTO_SMOOTH_SPAN x points),
    whose average spans about that many points; 0 (none) for a short curve."""
    return max(0.0, 1 - 1 / (AUTO_SMOOTH_SPAN * points)) if points else 0.0


def loss_limits(values: list[float]) -> tuple[float, float] | None:
    """(bottom, top) of a loss axis over these losses: from the lowest to LOSS_QUANTILE's loss plus
    LOSS_HEADROOM of that span (never past the highest), padded by 5%; None when they are all one value.
    Non-finite losses are left out."""
    finite = sorted(v for v in values if math.isfinite(v))
    if not finite or finite[0] == finite[-1]:
        return None
    low, quantile = finite[0], finite[round(LOSS_QUANTILE * (len(finite) - 1))]
    high = min(finite[-1], quantile + LOSS_HEADROOM * (quantile - low)) if quantile > low else finite[-1]
    pad = 0.05 * (high - low)
    return (low - pad if low - pad > 0 else low / 2), high + pad


def time_unit(seconds: float) -> tuple[float, str]:
    """(divisor, unit) that keeps a wall-clock axis readable: seconds, minutes or hours."""
    if seconds >= 3 * 3600:
        return 3600.0, "h"
    return (60.0, "min") if seconds >= 180 else (1.0, "s")


def _draw_curve(ax, xs, ys, key: str, label: str, colour, keys: tuple, smooth: float | None) -> None:
    """One run's curve of one key: val_loss as markers on a dashed line; a per-step curve as a line, and where
    its ema factor (`smooth`, or auto_smoothing's for None) is above 0, smoothed, over its raw values drawn
    faintly, unlabelled, behind it."""
    name = label + ((" (val)" if key == "val_loss" else " (train)") if len(keys) > 1 else "")
    name = f" {name}" if name.startswith("_") else name  # matplotlib leaves a label starting with _ out of legends
    if key == "val_loss":
        ax.plot(xs, ys, color=colour, marker="o", markersize=4, linestyle="--", linewidth=1.2, label=name)
        return
    smooth = auto_smoothing(len(ys)) if smooth is None else smooth
    if smooth and key in SMOOTHED_KEYS:
        ax.plot(xs, ys, color=colour, linewidth=0.6, alpha=0.2)
        ys = ema(ys, smooth)
    ax.plot(xs, ys, color=colour, linewidth=1.5, label=name)


def _x_axis(ax, runs: dict[str, list[dict]], x: str) -> float:
    """Label the bottom axis for x; -> what x values are divided by (time in minutes or hours)."""
    if x == "tokens":
        ax.set_xlabel("tokens")
        ax.xaxis.set_major_formatter(EngFormatter())
        return 1.0
    if x == "step":
        ax.set_xlabel("step")
        return 1.0
    longest = max((r.get("time_s", 0) for records in runs.values() for r in records), default=0)
    divisor, unit = time_unit(longest)
    ax.set_xlabel(f"wall-clock time ({unit})")
    return divisor


def draw_runs(runs: dict[str, list[dict]], panels=DEFAULT_PANELS, title: str | None = None,
              target: tuple[float, str] | None = None, loss_ylim: tuple[float, float] | None = None,
              x: str = "tokens", smooth: float | None = None, log_y: bool = False):
    """The figure of plot_runs, not yet saved: -> a matplotlib Figure."""
    logged = {key for records in runs.values() for r in records for key, v in r.items()
              if isinstance(v, (int, float)) and not isinstance(v, bool)}
    unknown = [p for p in panels if p not in PANELS and p not in logged]
    if unknown and any(unknown[0] in r for records in runs.values() for r in records):
        why = " (mfu needs a peak FLOP/s: a GPU in hardware.py's datasheet table, or --peak-tflops)"
        raise ValueError(f"panel {unknown[0]!r}: the runs logged it without a value"
                         + (why if unknown[0] == "mfu" else ""))
    if unknown:
        raise ValueError(f"unknown panel {unknown[0]!r}: neither one of {', '.join(PANELS)} nor a number the "
                         "runs logged")
    fig, axes = plt.subplots(len(panels), 1, figsize=(8, 3.2 * len(panels)), sharex=True, squeeze=False)
    divisor = _x_axis(axes[-1, 0], runs, x)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, panel in zip(axes[:, 0], panels):
        ylabel, keys = PANELS.get(panel, (panel, (panel,)))  # any logged metric is a panel of its own
        drawn = []
        for i, (label, records) in enumerate(runs.items()):
            for key in keys:
                xs, ys = series(records, key, x)
                drawn += ys
                if xs:
                    _draw_curve(ax, [v / divisor for v in xs], ys, key, label, colours[i % len(colours)], keys, smooth)
        if "loss" not in panel:
            ax.set_ylim(bottom=0)  # tokens/s and the LR: a fall to half reads as half
        else:
            if target is not None:
                ax.axhline(target[0], color="black", linestyle="--", linewidth=1, label=target[1])
            if log_y:  # plain numbers on the ticks: a loss axis spans far less than a decade
                ax.set_yscale("log")
                ax.yaxis.set_major_formatter(LogFormatter())
                ax.yaxis.set_minor_formatter(LogFormatter())
            if (limits := loss_ylim or loss_limits(drawn)) is not None:
                ax.set_ylim(*limits)
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3, which="both" if log_y and "loss" in panel else "major")
        if ax.has_data():
            ax.legend(fontsize=8)
    axes[-1, 0].set_xlim(left=0)  # the run from its start (the axes share x)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def plot_runs(runs: dict[str, list[dict]], out_png: str, panels=DEFAULT_PANELS, title: str | None = None,
              target: tuple[float, str] | None = None, loss_ylim: tuple[float, float] | None = None,
              x: str = "tokens", smooth: float | None = None, log_y: bool = False) -> None:
    """Draw one panel per name in panels (PANELS, or any number the runs logged, by its metrics.jsonl name),
    every run overlaid, and save a PNG.

    target, as (loss, label), draws a dashed horizontal line on the loss panels: a loss to reach.
    loss_ylim zooms the loss panels, whose first evals are far above the losses worth comparing; without it
    they span loss_limits.
    x: the horizontal axis (X_KEYS); smooth: the ema factor for SMOOTHED_KEYS (0: off; None: auto_smoothing's);
    log_y: log-scale loss panels.

    The file is written at out_png exactly, in the format its extension names (PNG without one), under a
    temporary name first (atomic.replace_with), so that a kill never leaves half an image under out_png; an
    OSError writing it is cli.WriteError, one line naming the file. Its directory is made if need be (OSError
    where it cannot be), once the figure is drawn: a panel refused above leaves no directory behind.
    """
    fig = draw_runs(runs, panels, title, target, loss_ylim, x, smooth, log_y)
    try:
        os.makedirs(os.path.dirname(os.path.abspath(out_png)), exist_ok=True)
        fmt = os.path.splitext(out_png)[1][1:].lower() or "png"
        replace_with(out_png, lambda f: fig.savefig(f, dpi=120, format=fmt), what="figure")
    finally:
        plt.close(fig)
