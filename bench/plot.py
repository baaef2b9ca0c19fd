"""Training curves from train.py's metrics.jsonl: loss, tokens/s and learning rate against tokens.

    python bench/plot.py OUT_DIR [OUT_DIR ...] [--labels NAME ...] [--out curves.png]

Several runs are overlaid, one colour each, labelled by their directory name (or --labels).
Other benchmarks import read_metrics() and plot_runs() to draw their own figures.
"""

import argparse
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")  # files only: no display is needed, or present on CI and servers
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import EngFormatter  # noqa: E402

# Panel name -> (y-axis label, metrics keys drawn on it). "loss" shows train and val together.
PANELS = {
    "loss": ("loss", ("train_loss", "val_loss")),
    "val_loss": ("validation loss", ("val_loss",)),
    "train_loss": ("train loss", ("train_loss",)),
    "tokens_per_sec": ("tokens/s", ("tokens_per_sec",)),
    "lr": ("learning rate", ("lr",)),
}
DEFAULT_PANELS = ("loss", "tokens_per_sec", "lr")


class MetricsError(Exception):
    """A metrics file that is missing or unreadable, or a bad command line; reported in one line."""


def read_metrics(out_dir: str) -> list[dict]:
    """The records of out_dir/metrics.jsonl, in file order."""
    path = os.path.join(out_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise MetricsError(f"{path}: no such file (is {out_dir} a train.py --out-dir?)")
    records = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                raise MetricsError(f"{path}:{lineno}: not a JSON line") from None
            if not isinstance(record, dict) or "tokens" not in record:
                raise MetricsError(f"{path}:{lineno}: a record without a 'tokens' field")
            records.append(record)
    if not records:
        raise MetricsError(f"{path} has no records")
    return records


def series(records: list[dict], key: str) -> tuple[list[float], list[float]]:
    """(tokens, values) of the records that carry a number under key; val_loss is only on eval steps."""
    points = [(r["tokens"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
    return [t for t, _ in points], [v for _, v in points]


def plot_runs(runs: dict[str, list[dict]], out_png: str, panels=DEFAULT_PANELS, title: str | None = None,
              target: tuple[float, str] | None = None, loss_ylim: tuple[float, float] | None = None) -> None:
    """Draw one panel per name in panels (see PANELS), every run overlaid, and save a PNG.

    target, as (loss, label), draws a dashed horizontal line on the loss panels: a loss to reach.
    loss_ylim zooms the loss panels, whose first evals are far above the losses worth comparing.
    """
    unknown = [p for p in panels if p not in PANELS]
    if unknown:
        raise ValueError(f"unknown panel {unknown[0]!r}; choose from {', '.join(PANELS)}")
    fig, axes = plt.subplots(len(panels), 1, figsize=(8, 3.2 * len(panels)), sharex=True, squeeze=False)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, panel in zip(axes[:, 0], panels):
        ylabel, keys = PANELS[panel]
        for i, (label, records) in enumerate(runs.items()):
            colour = colours[i % len(colours)]
            for key in keys:
                xs, ys = series(records, key)
                if not xs:
                    continue
                if key == "val_loss":
                    name = f"{label} (val)" if len(keys) > 1 else label
                    ax.plot(xs, ys, color=colour, marker="o", markersize=4, linewidth=1.5, label=name)
                else:
                    # A lone train curve is the main line; beside val markers it is the faint noisy one.
                    faint = len(keys) > 1
                    name = f"{label} (train)" if faint else label
                    ax.plot(xs, ys, color=colour, linewidth=0.8 if faint else 1.5, alpha=0.45 if faint else 1.0,
                            label=name)
        if "loss" in panel:
            if target is not None:
                ax.axhline(target[0], color="black", linestyle="--", linewidth=1, label=target[1])
            if loss_ylim is not None:
                ax.set_ylim(*loss_ylim)
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        if ax.has_data():
            ax.legend(fontsize=8)
    axes[-1, 0].set_xlabel("tokens")
    axes[-1, 0].xaxis.set_major_formatter(EngFormatter())
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out_png)), exist_ok=True)
    fig.savefig(out_png, dpi=120)
    plt.close(fig)


def run_labels(out_dirs: list[str]) -> list[str]:
    """Directory names, or the paths as given where two directories share a name."""
    names = [os.path.basename(os.path.normpath(d)) for d in out_dirs]
    return [n if names.count(n) == 1 else d for n, d in zip(names, out_dirs)]


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise MetricsError(message)


def main(argv=None):
    p = _Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_dirs", nargs="+", metavar="OUT_DIR", help="train.py --out-dir of each run")
    p.add_argument("--labels", nargs="+", help="legend names, one per OUT_DIR (default: directory names)")
    p.add_argument("--out", default="curves.png", help="PNG to write")
    p.add_argument("--title")
    try:
        a = p.parse_args(argv)
        labels = a.labels or run_labels(a.out_dirs)
        if len(labels) != len(a.out_dirs):
            raise MetricsError(f"--labels gives {len(labels)} names for {len(a.out_dirs)} OUT_DIRs")
        if len(set(labels)) != len(labels):
            raise MetricsError("--labels must be distinct")
        runs = {label: read_metrics(d) for label, d in zip(labels, a.out_dirs)}
    except MetricsError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    plot_runs(runs, a.out, title=a.title)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
