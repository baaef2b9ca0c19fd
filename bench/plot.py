"""Training curves from train.py's metrics.jsonl, as a command: curves.py draws them.

    python bench/plot.py OUT_DIR [OUT_DIR ...] [--labels NAME ...] [--out curves.png]
    python bench/plot.py out --smooth 0.9 --log-y --x time    # smoothed more, log-scale loss, against the clock

Several runs are overlaid, one colour each, labelled by their directory name (or --labels). Without --out
the figure goes to the first OUT_DIR, as OUT_DIR/curves.png, beside the metrics it was drawn from.
"""

import argparse
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository's modules
from curves import DEFAULT_PANELS, PANELS, X_KEYS, check_x, plot_runs, read_metrics  # noqa: E402
from runlog import MetricsError  # noqa: E402


def run_labels(out_dirs: list[str]) -> list[str]:
    """Directory names, or the paths as given where two directories share a name."""
    names = [os.path.basename(os.path.normpath(d)) for d in out_dirs]
    return [n if names.count(n) == 1 else d for n, d in zip(names, out_dirs)]


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise MetricsError(message)


def smoothing(text: str) -> float | None:
    """--smooth: an ema factor in [0, 1), or auto (None: auto_smoothing's)."""
    if text == "auto":
        return None
    try:
        factor = float(text)
    except ValueError:
        factor = math.nan
    if not 0 <= factor < 1:
        raise argparse.ArgumentTypeError(f"must be an ema factor in [0, 1) (0.9: about the last ten points) or "
                                         f"auto, got {text!r}")
    return factor


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_dirs", nargs="+", metavar="OUT_DIR", help="train.py --out-dir of each run")
    p.add_argument("--labels", nargs="+", help="legend names, one per OUT_DIR (default: directory names)")
    p.add_argument("--out", help="PNG to write (default: curves.png in the first OUT_DIR)")
    p.add_argument("--title")
    p.add_argument("--x", choices=tuple(X_KEYS), default="tokens",
                   help="horizontal axis: step, tokens, or time (wall clock since the run started, across "
                        "resumes: the time_s of each record)")
    p.add_argument("--smooth", type=smoothing, default=None, metavar="FACTOR",
                   help="exponential moving average of the per-step curves (train loss, tokens/s), debiased as "
                        "TensorBoard's: 0 off, 0.9 about the last ten steps, auto (default) about 1%% of the "
                        "curve's points (none under 100); the raw curve stays, faint, behind it. Val loss and the "
                        "LR are drawn as they are")
    p.add_argument("--log-y", action="store_true", help="log-scale loss axis")
    p.add_argument("--panels", nargs="+", default=list(DEFAULT_PANELS), metavar="NAME",
                   help=f"one panel each: {', '.join(PANELS)}, or any number metrics.jsonl holds, by its name "
                        f"(default: {' '.join(DEFAULT_PANELS)})")
    return p


def main(argv=None):
    try:
        a = build_parser().parse_args(argv)
        labels = a.labels or run_labels(a.out_dirs)
        if len(labels) != len(a.out_dirs):
            raise MetricsError(f"--labels gives {len(labels)} names for {len(a.out_dirs)} OUT_DIRs")
        if len(set(labels)) != len(labels):
            raise MetricsError("--labels must be distinct")
        runs = {label: read_metrics(d) for label, d in zip(labels, a.out_dirs)}
        for d, records in zip(a.out_dirs, runs.values()):
            check_x(records, a.x, os.path.join(d, "metrics.jsonl"))
    except MetricsError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    out = a.out or os.path.join(a.out_dirs[0], "curves.png")
    try:
        plot_runs(runs, out, panels=a.panels, title=a.title, x=a.x, smooth=a.smooth, log_y=a.log_y)
    except ValueError as e:  # a panel neither drawn by name nor logged
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
