"""Training curves from train.py's metrics.jsonl, as a command: curves.py draws them.

    python bench/plot.py OUT_DIR [OUT_DIR ...] [--labels NAME ...] [--out curves.png]
    python bench/plot.py out --smooth 0.9 --log-y --x time    # smoothed more, log-scale loss, against the clock

Several runs are overlaid, one colour each, labelled by their directory name (or --labels). Without --out
the figure goes to the first OUT_DIR, as OUT_DIR/curves.png, beside the metrics it was drawn from.

--out's extension picks the format (FORMATS; a name without one gets .png, as matplotlib gives it). What is
replaced: a file that --out names, as plotting tools do (naming it is asking for it); without --out,
OUT_DIR/curves.png, which is the run's own figure (report.py writes it at every run's end, from the same
metrics), not the user's. A directory or another thing that is no file, where the figure would go, is refused,
and so is a parent that is a file. The figure is written under a temporary name, then renamed (curves.plot_runs),
so that a kill never leaves half an image under its name.
"""

import argparse
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository's modules
from atomic import in_the_way  # noqa: E402
from cli import ArgumentParser, UsageError, WriteError, report_error  # noqa: E402
from curves import DEFAULT_PANELS, PANELS, X_KEYS, check_x, plot_runs, read_metrics  # noqa: E402
from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: E402 (curves has chosen the Agg backend)
from runlog import MetricsError  # noqa: E402

# What --out may end in: the formats matplotlib saves, less pgf (it needs a LaTeX install) and raw and rgba
# (bare pixel buffers, with no header an image viewer could read).
FORMATS = tuple(sorted(set(FigureCanvasAgg.get_supported_filetypes()) - {"pgf", "raw", "rgba"}))


def run_labels(out_dirs: list[str]) -> list[str]:
    """Directory names, or the paths as given where two directories share a name."""
    names = [os.path.basename(os.path.normpath(d)) for d in out_dirs]
    return [n if names.count(n) == 1 else d for n, d in zip(names, out_dirs)]


def output_path(out: str | None, first_dir: str) -> str:
    """The file to write: --out, with .png added where it has no extension (as matplotlib's savefig adds it),
    or without --out first_dir/curves.png. UsageError, before anything is drawn, for an extension that is not
    a format in FORMATS, or a directory (or another thing that is no file) where the figure would go, or a
    parent that is a file."""
    if out is None:
        path = os.path.join(first_dir, "curves.png")
    else:
        if not out:
            raise UsageError("--out is empty: name the file to write, as --out curves.png")
        if out.endswith(("/", os.sep)) or os.path.isdir(out):
            raise UsageError(f"--out {out} names a directory, not a file; name the file to write, as "
                             f"--out {os.path.join(out, 'curves.png')}")
        fmt = os.path.splitext(out)[1][1:].lower()
        if fmt and fmt not in FORMATS:
            raise UsageError(f"--out {out}: no .{fmt} figures; end the name in one of "
                             f"{', '.join('.' + f for f in FORMATS)} (no extension: .png)")
        path = out if fmt else out.rstrip(".") + ".png"
    where = "" if out is None else f"--out {out}: "
    if kind := in_the_way(path):
        raise UsageError(f"{where}{path} is {kind}, which the figure would replace; move it aside"
                         + (", or pass --out" if out is None else ""))
    parent = os.path.dirname(path)
    while parent and not os.path.exists(parent):  # plot_runs makes these: the nearest one there must be one
        parent = os.path.dirname(parent)
    if parent and not os.path.isdir(parent):
        raise UsageError(f"{where}{parent} is a file, not a directory to write the figure in")
    return path


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
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_dirs", nargs="+", metavar="OUT_DIR", help="train.py --out-dir of each run")
    p.add_argument("--labels", nargs="+", help="legend names, one per OUT_DIR (default: directory names)")
    p.add_argument("--out", help="the figure to write, in the format its extension names (.png, .pdf, .svg, ...; "
                                 "none: .png); replaced if it is there (default: curves.png in the first OUT_DIR)")
    p.add_argument("--title")
    p.add_argument("--x", choices=tuple(X_KEYS), default="tokens",
                   help="horizontal axis: step, tokens, or time (wall clock since the run started, across "
                        "resumes: the time_s of each record) (default: tokens)")
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
            twice = next(d for d in a.out_dirs if a.out_dirs.count(d) > 1) if not a.labels else None
            raise MetricsError("--labels must be distinct" if a.labels else f"OUT_DIR {twice} is given twice")
        runs = {label: read_metrics(d) for label, d in zip(labels, a.out_dirs)}
        for d, records in zip(a.out_dirs, runs.values()):
            check_x(records, a.x, os.path.join(d, "metrics.jsonl"))
        out = output_path(a.out, a.out_dirs[0])  # once the runs are read: the first OUT_DIR is a directory
    except (MetricsError, UsageError) as e:
        sys.exit(report_error(e))
    try:
        plot_runs(runs, out, panels=a.panels, title=a.title, x=a.x, smooth=a.smooth, log_y=a.log_y)
    except (ValueError, WriteError) as e:  # a panel neither drawn by name nor logged; a figure not written
        sys.exit(report_error(e))
    except OSError as e:  # making its directory (output_path saw nothing in the way: a race, or permissions)
        where = "" if a.out is None else f"--out {a.out}: "
        sys.exit(report_error(f"{where}cannot make the directory {e.filename} for {out}: {e.strerror or e}"))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
