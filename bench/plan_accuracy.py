"""The time row against the run it plans: the start-up table's planned step and run beside the measured ones.

    python bench/plan_accuracy.py [--shapes default depth6 preset] [--out FILE.md]

Each shape is train.py's own set-up (its flags below, on the default corpus): the time row is read from its
start-up table (what a user sees: micro-steps, the optimizer, evals and checkpoints), then the whole loop
(loop.run_loop) is timed, evals, checkpoints and the first step included. The measured step is the median of
the steps past the first (metrics.jsonl's tokens_per_sec). A plan within 1.5x of the measured run passes (the issue's target);
the last column says.
"""

import contextlib
import datetime
import io
import json
import os
import re
import shlex
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from atomic import atomic_write  # noqa: E402
import config  # noqa: E402
import hardware  # noqa: E402
import loop  # noqa: E402
import train  # noqa: E402
from cli import HelpFormatter, ScriptParser, out_problem, run_writing_results  # noqa: E402

# name -> (what it shows, train.py flags): the default run; a deeper model by the size dial, its horizon cut to
# 3 steps (64 micro-steps each); the gpt2-124m preset at one sequence of 256 a micro-step (Muon on 78M matrix
# parameters).
SHAPES = {
    "default": ("train.py's default", []),
    "depth6": ("--depth 6, 3 steps", ["--depth", "6", "--max-steps", "3"]),
    "preset": ("gpt2-124m at 1 x 256, 3 steps",
               ["--preset", "gpt2-124m", "--batch-size", "1", "--seq-len", "256", "--total-batch-tokens", "4096",
                "--max-steps", "3", "--eval-interval", "0"]),
}
WITHIN = 1.5


def read_seconds(text: str) -> float:
    """A time as plan._seconds writes it: '0.853 s', '4m05s', '7h30m', '1.5 days'."""
    if text.endswith(" days"):
        return 86400 * float(text[:-5].replace(",", ""))
    if text.endswith(" s"):
        return float(text[:-2])
    hours, minutes, seconds = re.fullmatch(r"(?:(\d+)h)?(\d+)m(?:(\d+)s)?", text).groups()
    return 3600 * int(hours or 0) + 60 * int(minutes) + int(seconds or 0)


def planned(table: str) -> tuple[float, float, str]:
    """The time row of a start-up table -> (a step's seconds, the run's seconds, the row after 'the run')."""
    step, run, rest = re.search(r"^  time +a step ~(.+?) \(.*\), the run ~(\S+(?: s| days)?)(.*)$", table,
                                re.M).groups()
    return read_seconds(step), read_seconds(run), rest.strip()


def measure_shape(flags: list[str]) -> dict:
    """Set up train.py with flags, read its time row, then time its loop -> the row's figures."""
    with tempfile.TemporaryDirectory() as out_dir:
        table = io.StringIO()
        with contextlib.redirect_stdout(table):
            run = train.setup(config.parse_args([*flags, "--out-dir", out_dir]))
            try:
                start = time.perf_counter()
                loop.run_loop(run)
                hardware.synchronize(run.device)
                seconds = time.perf_counter() - start
            finally:
                run.close()
        with open(os.path.join(out_dir, "metrics.jsonl")) as f:  # a step's time from its tokens/s
            times = [run.layout.tokens_per_step / r["tokens_per_sec"] for r in map(json.loads, f) if r["tokens_per_sec"]]
    step, run_s, besides = planned(table.getvalue())
    return {"planned_step": step, "planned_run": run_s, "besides": besides, "steps": len(times),
            "measured_step": statistics.median(times[1:] or times), "measured_run": seconds}


def main(argv=None):
    p = ScriptParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES), help="which shapes to run")
    p.add_argument("--out", default=None, help="also write the table to this markdown file")
    args = p.parse_args(argv)
    if problem := out_problem(args.out):
        p.error(problem)
    lines = ["# The time row against the run it plans", "",
             f"- command: `python bench/plan_accuracy.py {shlex.join(argv if argv is not None else sys.argv[1:])}`",
             f"- machine: {hardware.cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}; "
             f"date {datetime.date.today()}", "",
             "| shape | flags | planned step | measured step (median) | planned run | counted besides steps | "
             "measured run | planned / measured run | within 1.5x |", "|---|---|---|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    for name in args.shapes:
        what, flags = SHAPES[name]
        m = measure_shape(flags)
        ratio = m["planned_run"] / m["measured_run"]
        row = (f"| {what} | `{shlex.join(flags)}` | {m['planned_step']:.3g} s | {m['measured_step']:.3g} s | "
               f"{m['planned_run']:.3g} s | {m['besides']} | {m['measured_run']:.3g} s | {ratio:.2f} | "
               f"{'yes' if 1 / WITHIN <= ratio <= WITHIN else 'no'} |")
        lines.append(row)
        print(row, flush=True)
    if args.out:
        atomic_write(args.out, ("\n".join(lines) + "\n").encode())


if __name__ == "__main__":
    run_writing_results(main)
