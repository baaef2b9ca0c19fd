"""Recipe toggles, measured: each toggle is a few extra train.py flags, run against a baseline at one token budget.

    python bench/recipe.py [--optimizer muon] [--max-tokens 307200] [--seeds 1 2] [--only wsd,normuon]
                           [--toggle "packing=--packing bos"] [--jobs 2] [--out bench/results/recipe.md]
                           [any train.py flags]

Every (toggle, seed) pair is one `python train.py` run (the default: train.py's small model on the embedded
stdlib corpus) in its own --out-dir under a temporary directory (--runs-dir keeps them), trained for exactly
--max-tokens tokens (train.py counts the batch warm-up's smaller steps, so that toggle trains as many) with
--seed as the seed of the initialisation and the data order. Only the final validation loss is evaluated, on
the same val tokens for every run; it is read from the run's metrics.jsonl. The baseline always runs.

The table has, per toggle: its flags, the final val loss of each seed, their mean, their spread (max - min),
the mean's delta against the baseline's, and whether |delta| exceeds the noise, taken as the larger of the two
spreads (with one seed there is no noise estimate, so no verdict). A toggle that cannot apply (a Muon option
under --optimizer adamw, the batch warm-up without gradient accumulation) is listed as n/a, with why.

Unless the train.py flags choose the batch (--batch-size, --grad-accum, --total-batch-tokens), every run uses
micro-batches of 4 x 4 micro-steps: train.py's global batch of 16 sequences, cut so that the batch warm-up has
micro-steps to ramp, and the same for every toggle so that they differ in nothing else. --jobs runs that many
trainings at once, each with OMP_NUM_THREADS = CPU cores / jobs.
"""

import argparse
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import config  # noqa: E402
from cli import HelpFormatter, UsageError  # noqa: E402
from optimizers import code_line, cpu_model  # noqa: E402
from plot import MetricsError, read_metrics  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Set by this script for every run; passed through they would make the runs disagree with the table.
OWN_TRAIN_FLAGS = ("--optimizer", "--out-dir", "--seed", "--max-tokens", "--max-steps", "--resume", "--overwrite")
BATCH_FLAGS = ("--batch-size", "--grad-accum", "--total-batch-tokens")
BATCH_DEFAULTS = ["--batch-size", "4", "--grad-accum", "4"]
# Overridable by train.py flags on the command line: evaluate once, at the end; one checkpoint, at the end.
EVAL_DEFAULTS = ["--eval-interval", str(10**9), "--ckpt-interval", "0"]
BATCH_WARMUP_STEPS = 30  # a fifth of the default budget's 150 steps


class BenchError(Exception):
    """A bad flag or a failed run; reported in one line, exit code 2."""


# ----------------------------------------------------------------------------- the toggles


def default_toggles(side_lr: float) -> dict[str, tuple[list[str], bool]]:
    """name -> (train.py flags, whether it needs --optimizer muon). side_lr: the AdamW side's peak LR, which
    the embedding and lm_head LRs are set relative to (3x and 0.5x: a guess to measure, not a tuned value)."""
    return {
        "baseline": ([], False),
        "wsd": (["--schedule", "wsd"], False),
        "zero-init-proj": (["--zero-init-proj"], False),
        "polar-express": (["--ns-coeffs", "polar-express"], True),
        "normuon": (["--normuon"], True),
        "cautious-wd": (["--cautious-wd"], False),
        "batch-warmup": (["--batch-warmup-steps", str(BATCH_WARMUP_STEPS)], False),
        "untied": (["--untied"], False),
        "untied-embed-head-lr": (["--untied", "--embed-lr", f"{3 * side_lr:g}", "--head-lr", f"{side_lr / 2:g}"],
                                 False),
    }


def not_applicable(flags: list[str], muon_only: bool, cfg) -> str | None:
    """Why a toggle cannot run under cfg (the runs' common configuration), or None if it can."""
    if muon_only and cfg.optim.name != "muon":
        return "needs --optimizer muon"
    if "--batch-warmup-steps" in flags and cfg.data.grad_accum == 1 and not cfg.data.total_batch_tokens:
        return "needs gradient accumulation (--grad-accum > 1) to ramp"
    return None


# ----------------------------------------------------------------------------- flags


def parse_toggle(text: str) -> tuple[str, list[str]]:
    name, sep, flags = text.partition("=")
    if not sep or not name.strip() or not flags.strip():
        raise argparse.ArgumentTypeError(f"expected NAME=FLAGS, got {text!r}")
    return name.strip(), shlex.split(flags)


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise BenchError(message)


def parse_bench_args(argv):
    """-> (bench args, train.py flags to pass through)."""
    p = _Parser(description=__doc__, formatter_class=HelpFormatter, allow_abbrev=False)
    p.add_argument("--optimizer", default="muon", help="train.py's --optimizer for every run")
    p.add_argument("--max-tokens", type=int, default=307200, help="tokens per run (default: %(default)s, train.py's "
                                                                  "150 steps of 16 x 128 tokens)")
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2],
                   help="one run per seed per toggle (default: 1 2)")
    p.add_argument("--only", help="comma-separated toggles to run (the baseline runs anyway)")
    p.add_argument("--toggle", type=parse_toggle, action="append", default=[], metavar="NAME=FLAGS",
                   help='another toggle, e.g. "packing=--packing bos" (repeatable)')
    p.add_argument("--jobs", type=int, default=1, help="trainings at once")
    p.add_argument("--out", default=os.path.join(REPO, "bench", "results", "recipe.md"),
                   help="the markdown table (default: bench/results/recipe.md)")
    p.add_argument("--runs-dir", help="keep the runs' directories here (default: a temporary directory)")
    a, train_argv = p.parse_known_args(argv)
    if a.max_tokens < 1 or a.jobs < 1 or len(set(a.seeds)) != len(a.seeds):
        raise BenchError("--max-tokens and --jobs must be >= 1, and --seeds distinct")
    for arg in train_argv:
        if arg.split("=")[0] in OWN_TRAIN_FLAGS:
            raise BenchError(f"{arg.split('=')[0]} is set by this benchmark; see --help for its own flags")
    return a, train_argv


def common_flags(a, train_argv) -> list[str]:
    """The flags every run shares, toggles and --out-dir / --seed aside; the bench's defaults come first, so the
    command line's train.py flags override them."""
    batch = [] if any(arg.split("=")[0] in BATCH_FLAGS for arg in train_argv) else BATCH_DEFAULTS
    return [*EVAL_DEFAULTS, *batch, *train_argv, "--optimizer", a.optimizer, "--max-tokens", str(a.max_tokens)]


def select_toggles(a, cfg) -> dict[str, tuple[list[str], str | None]]:
    """name -> (flags, why it cannot run or None), the baseline first, in the order they are listed."""
    side_lr = cfg.optim.adam_lr if cfg.optim.name == "muon" and cfg.optim.adam_lr is not None else cfg.optim.lr
    toggles = {name: (flags, muon_only) for name, (flags, muon_only) in default_toggles(side_lr).items()}
    for name, flags in a.toggle:
        if name in toggles:
            raise BenchError(f"--toggle {name}: that name is taken")
        toggles[name] = (flags, False)
    chosen = list(toggles)
    if a.only:
        chosen = [name.strip() for name in a.only.split(",") if name.strip()]
        unknown = [name for name in chosen if name not in toggles]
        if unknown or not chosen:
            raise BenchError(f"--only: unknown toggle {unknown[0]!r}; the toggles are {', '.join(toggles)}"
                             if unknown else "--only is empty")
        chosen = ["baseline"] + [name for name in chosen if name != "baseline"]
    return {name: (toggles[name][0], not_applicable(toggles[name][0], toggles[name][1], cfg)) for name in chosen}


# ----------------------------------------------------------------------------- runs


def final_val_loss(out_dir: str) -> tuple[float, int]:
    """-> (the val loss of the run's final step, the tokens it trained)."""
    last = read_metrics(out_dir)[-1]
    if "val_loss" not in last:
        raise BenchError(f"{out_dir}/metrics.jsonl: the last step has no val_loss (was evaluation turned off?)")
    loss = last["val_loss"]
    return (float("nan") if loss is None else float(loss)), last["tokens"]


def train_once(cmd: list[str], out_dir: str, threads: int) -> tuple[float, int, float]:
    """One training to completion, its output in out_dir/train.log -> (final val loss, tokens, wall seconds)."""
    os.makedirs(out_dir, exist_ok=True)
    log_path = os.path.join(out_dir, "train.log")
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        code = subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env).returncode
    wall = time.perf_counter() - t0
    if code != 0:
        with open(log_path) as f:
            last = [line.strip() for line in f if line.strip()][-1:] or ["(no output)"]
        raise BenchError(f"{shlex.join(cmd)} exited with {code}: {last[0]}")
    return (*final_val_loss(out_dir), wall)


def run_all(jobs: list[tuple], n_jobs: int, threads: int) -> dict[tuple, tuple[float, int, float]]:
    """jobs: (toggle, seed, command, out dir) -> {(toggle, seed): (val loss, tokens, wall)}, n_jobs at a time."""
    def one(job):
        toggle, seed, cmd, out_dir = job
        print(f"[run] {toggle}, seed {seed}: {shlex.join(cmd)}", flush=True)
        result = train_once(cmd, out_dir, threads)
        print(f"      {toggle}, seed {seed}: final val loss {result[0]:.4f}, {result[2]:.0f} s", flush=True)
        return result

    pool = ThreadPoolExecutor(max_workers=n_jobs)
    try:
        futures = {job[:2]: pool.submit(one, job) for job in jobs}
        return {key: future.result() for key, future in futures.items()}
    finally:  # after a failed run, the runs not yet started are not started
        pool.shutdown(cancel_futures=True)


# ----------------------------------------------------------------------------- report


def summarize(losses: dict[str, list[float]]) -> dict[str, dict]:
    """toggle -> its seeds' final val losses (the baseline's among them) -> toggle -> mean, spread (max - min),
    delta (mean - the baseline's mean) and beyond_noise (|delta| > the larger of its and the baseline's
    spreads; None with fewer than two seeds, where there is no spread to compare with)."""
    base = losses["baseline"]
    base_mean, base_spread = statistics.fmean(base), max(base) - min(base)
    rows = {}
    for name, values in losses.items():
        mean, spread = statistics.fmean(values), max(values) - min(values)
        delta = mean - base_mean
        verdict = None if len(values) < 2 or name == "baseline" else abs(delta) > max(spread, base_spread)
        rows[name] = {"mean": mean, "spread": spread, "delta": delta, "beyond_noise": verdict}
    return rows


def table(selected: dict, results: dict, seeds: list[int], header: list[str]) -> str:
    """The markdown report: the header lines, then one row per toggle."""
    ran = {name: [results[name, seed][0] for seed in seeds] for name, (_, why) in selected.items() if why is None}
    rows = summarize(ran)
    lines = [*header, "", "| toggle | flags | final val loss per seed | mean | spread | delta vs baseline | "
             "beyond the spread | tokens | mean wall s |", "|---|---|---|---|---|---|---|---|---|"]
    for name, (flags, why) in selected.items():
        shown = f"`{shlex.join(flags)}`" if flags else "(none)"
        if why is not None:
            lines.append(f"| {name} | {shown} | n/a: {why} | | | | | | |")
            continue
        r = rows[name]
        verdict = {None: "-", True: "**yes**", False: "no"}[r["beyond_noise"]]
        delta = "-" if name == "baseline" else f"{r['delta']:+.4f}"
        per_seed = ", ".join(f"{v:.4f}" for v in ran[name])
        tokens = results[name, seeds[0]][1]
        wall = statistics.fmean(results[name, seed][2] for seed in seeds)
        lines.append(f"| {name} | {shown} | {per_seed} | {r['mean']:.4f} | {r['spread']:.4f} | {delta} | "
                     f"{verdict} | {tokens:,} | {wall:.0f} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    command = shlex.join(["python", "bench/recipe.py", *argv])
    try:
        a, train_argv = parse_bench_args(argv)
        flags = common_flags(a, train_argv)
        cfg = config.parse_args(flags)  # the runs' common configuration, checked before any run starts
        selected = select_toggles(a, cfg)
        for name, (toggle_flags, why) in selected.items():
            if why is None:  # optim.py's checks run at train.py's start-up: run them here, before any run
                config.parse_args([*flags, *toggle_flags]).optim.validate()
    except (BenchError, UsageError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    threads = max(1, cores // a.jobs)
    header = ["# Recipe toggles", "", f"- command: `{command}`",
              f"- common train.py flags: `{shlex.join(flags)}`; seeds {', '.join(map(str, a.seeds))}",
              f"- machine: CPU {cpu_model()}, {cores} cores; {a.jobs} run(s) at once with OMP_NUM_THREADS={threads}",
              f"- code: {code_line()}",
              "- noise: a delta counts (**yes**) only when it exceeds both the toggle's and the baseline's spread "
              "over seeds"]
    with tempfile.TemporaryDirectory(prefix="recipe_") as tmp:
        runs_dir = a.runs_dir or tmp
        jobs = [(name, seed, [sys.executable, os.path.join(REPO, "train.py"), *flags, *toggle_flags,
                              "--seed", str(seed), "--out-dir", os.path.join(runs_dir, f"{name}_seed{seed}"),
                              "--overwrite"],  # a --runs-dir may hold an earlier invocation's runs
                 os.path.join(runs_dir, f"{name}_seed{seed}"))
                for name, (toggle_flags, why) in selected.items() if why is None for seed in a.seeds]
        try:
            results = run_all(jobs, a.jobs, threads)
        except (BenchError, MetricsError) as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)
    report = table(selected, results, a.seeds, header)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        f.write(report)
    print()
    print(report)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
