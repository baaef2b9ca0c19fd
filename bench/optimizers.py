"""Optimizer sample efficiency: the same model, data and token budget under each optimizer, at a few LRs.

    python bench/optimizers.py [--steps 64 --eval-every 8 --adamw-lrs 3e-3,6e-3 --muon-lrs 3e-3,6e-3]
                               [--reuse] [any train.py flags]

Each (optimizer, LR) pair is one `python train.py` run in its own --out-dir under --results-dir/runs,
one at a time. Train.py flags not set by this script pass through unchanged (model size, --seed,
--data; the default is train.py's small model on the embedded stdlib corpus). The script writes
--results-dir/optimizers.md, a table of final validation losses and of the tokens Muon needs to reach
AdamW's best final validation loss, and optimizers.png, validation loss against tokens for the best
LR of each optimizer.

The AdamW side of a Muon run (embeddings, norms) uses --muon-adam-lr, by default the best AdamW LR of
this sweep, so the comparison isolates what Muon does to the hidden matrices.
"""

import argparse
import json
import math
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import config  # noqa: E402
from atomic import atomic_write  # noqa: E402
import hardware  # noqa: E402
from cli import HelpFormatter, UsageError, run_writing_results  # noqa: E402
from curves import plot_runs, read_metrics, series  # noqa: E402
from runlog import MetricsError  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OPTIMIZERS = ("adamw", "muon", "adamw8bit")
# Set by this script for every run; passing them through would make the runs disagree with the table.
OWN_TRAIN_FLAGS = ("--optimizer", "--lr", "--adam-lr", "--out-dir", "--max-steps", "--max-tokens",
                   "--eval-interval", "--eval-tokens", "--ckpt-interval", "--resume")


# Written into each run's directory once the run finished: what ran and how long it took.
RUN_INFO = "bench_run.json"


class BenchError(Exception):
    """A bad flag or a failed run; reported in one line, exit code 2."""


# ----------------------------------------------------------------------------- analysis


def tokens_to_reach(curve: list[tuple[float, float]], target: float) -> float | None:
    """Tokens at which a (tokens, val loss) curve first gets down to target, or None if it never does.

    Between two evals the loss is taken as linear in tokens. Before the first eval there is no
    measurement, so a curve already at target there is credited with the first eval's tokens.
    Non-finite losses (a diverged run) never count as reaching it.
    """
    prev = None
    for tokens, loss in curve:
        if not math.isfinite(loss):
            prev = None
            continue
        if loss <= target:
            if prev is None:
                return float(tokens)
            t0, l0 = prev
            return t0 + (tokens - t0) * (l0 - target) / (l0 - loss)
        prev = (tokens, loss)
    return None


def final_val_loss(records: list[dict]) -> float:
    _, losses = series(records, "val_loss")
    return losses[-1] if losses else math.nan


def best_lr(results: dict[float, list[dict]]) -> float | None:
    """The LR whose run ends with the lowest finite val loss; None if every run diverged."""
    finite = {lr: final_val_loss(r) for lr, r in results.items() if math.isfinite(final_val_loss(r))}
    return min(finite, key=finite.get) if finite else None


# ----------------------------------------------------------------------------- flags


def parse_lrs(text: str) -> list[float]:
    try:
        lrs = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of numbers: {text!r}") from None
    if not lrs or any(not lr > 0 for lr in lrs):
        raise argparse.ArgumentTypeError(f"learning rates must be positive numbers, got {text!r}")
    return lrs


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise BenchError(message)


def parse_bench_args(argv):
    """-> (bench args, train.py flags to pass through)."""
    p = _Parser(description=__doc__, formatter_class=HelpFormatter, allow_abbrev=False)
    p.add_argument("--optimizers", default=",".join(OPTIMIZERS),
                   help="comma-separated, run in this order (adamw first: the defaults below use its best LR)")
    p.add_argument("--adamw-lrs", type=parse_lrs, default=[1.5e-3, 3e-3, 6e-3, 1.2e-2],
                   help="comma-separated AdamW LRs (default: 1.5e-3,3e-3,6e-3,1.2e-2)")
    p.add_argument("--adamw8bit-lrs", type=parse_lrs,
                   help="default: the best AdamW LR of this sweep (does 8-bit state track AdamW where it is tuned?)")
    p.add_argument("--muon-lrs", type=parse_lrs, default=[3e-3, 6e-3, 1.2e-2],
                   help="LR of the Muon matrices (muon.py's match_rms_adamw scale makes AdamW LRs carry over) "
                        "(default: 3e-3,6e-3,1.2e-2)")
    p.add_argument("--muon-adam-lr", type=float,
                   help="LR of the AdamW side of Muon runs (default: the best AdamW LR of this sweep)")
    p.add_argument("--steps", type=int, default=64, help="optimizer steps per run (the token budget)")
    p.add_argument("--eval-every", type=int, default=8, help="steps between val-loss evals")
    p.add_argument("--eval-tokens", type=int, default=4096, help="val tokens per eval (the same ones each time)")
    p.add_argument("--results-dir", default=os.path.join(REPO, "bench", "results"),
                   help="where each run's directory and the tables go (default: bench/results)")
    p.add_argument("--reuse", action="store_true",
                   help="skip a run whose directory holds a finished run of the identical command, at the settings "
                        "and precision it would have here")
    a, train_argv = p.parse_known_args(argv)
    a.optimizers = [o.strip() for o in a.optimizers.split(",") if o.strip()]
    bad = [o for o in a.optimizers if o not in OPTIMIZERS]
    if bad or not a.optimizers:
        raise BenchError(f"--optimizers: unknown {bad[0]!r}" if bad else "--optimizers is empty")
    if a.steps < 1 or a.eval_every < 1 or a.eval_tokens < 1:
        raise BenchError("--steps, --eval-every and --eval-tokens must be >= 1")
    if a.muon_adam_lr is not None and not a.muon_adam_lr > 0:
        raise BenchError(f"--muon-adam-lr must be positive, got {a.muon_adam_lr}")
    for arg in train_argv:
        if arg.split("=")[0] in OWN_TRAIN_FLAGS:
            raise BenchError(f"{arg.split('=')[0]} is set by this benchmark; see --help for its own flags")
    try:  # train.py's own refusal of a mistyped flag, before any run's directory is touched
        config.parse_args([*train_argv, "--max-steps", str(a.steps)])
    except (UsageError, ValueError) as e:
        raise BenchError(str(e)) from None
    return a, train_argv


# ----------------------------------------------------------------------------- runs


def run_name(optimizer: str, lr: float) -> str:
    return f"{optimizer}_lr{lr:g}"


def train_command(a, train_argv, optimizer, lr, adam_lr, out_dir) -> list[str]:
    cmd = [sys.executable, os.path.join(REPO, "train.py"), *train_argv, "--optimizer", optimizer, "--lr", f"{lr:g}",
           "--out-dir", out_dir, "--max-steps", str(a.steps), "--eval-interval", str(a.eval_every),
           "--eval-tokens", str(a.eval_tokens), "--ckpt-interval", "0"]
    if adam_lr is not None:
        cmd += ["--adam-lr", f"{adam_lr:g}"]
    return cmd


def resolved_settings(cmd: list[str]) -> dict:
    """Every setting a train.py command line resolves to, defaults included: the same command at a commit
    whose defaults differ is another run. As JSON reads it back (lists, not tuples)."""
    return json.loads(json.dumps(config.flat_values(config.parse_args(cmd[2:]))))


def finished_wall(out_dir: str, cmd: list[str], steps: int) -> float | None:
    """The wall time of a completed run of exactly cmd, at today's defaults and at the precision its --dtype
    chooses here, in out_dir (for --reuse), or None if there is none (a run recorded before its settings or
    precision were: None, so it runs again)."""
    try:
        with open(os.path.join(out_dir, RUN_INFO)) as f:
            info = json.load(f)
        complete = read_metrics(out_dir)[-1]["step"] == steps
    except (OSError, ValueError, MetricsError):
        return None
    same = info.get("command") == shlex.join(cmd) and info.get("settings") == resolved_settings(cmd)
    return info["wall_s"] if complete and same and recorded_precision(out_dir) == precision_here(cmd) else None


def recorded_precision(out_dir: str) -> str | None:
    """What the run's --dtype chose, from its summary.json: "fp32", "bf16 autocast", ... (None: not recorded)."""
    try:
        with open(os.path.join(out_dir, "summary.json")) as f:
            precision = json.load(f)["facts"].get("precision")
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return hardware.precision_name(precision) if isinstance(precision, str) else None


def precision_here(cmd: list[str]) -> str | None:
    """What cmd's --dtype chooses on this machine now: --dtype auto times a bf16 probe, which another CPU (or
    one under load) decides otherwise, so a run made elsewhere may have trained at another precision."""
    cfg = config.parse_args(cmd[2:])
    try:
        device, _ = hardware.resolve_device(cfg.speed.device)
        return hardware.precision_name(hardware.resolve_dtype(cfg.speed.dtype, device)[1])
    except UsageError:  # no such device here (a run made on a GPU): nothing to reuse; train.py says why in one line
        return None


def train_once(cmd: list[str], out_dir: str, settings: dict | None = None) -> float:
    """Run one training to completion in a fresh out_dir; returns its wall time in seconds. Output goes to
    out_dir/train.log. An earlier run there (the committed results, say) is moved aside and comes back if this
    one fails; it is removed only once this one has finished. settings: what cmd resolves to (resolved_settings),
    recorded with it for --reuse."""
    earlier = f"{out_dir}.earlier"
    if os.path.exists(earlier):
        raise BenchError(f"{earlier} holds a run an unfinished sweep moved aside: move it back to {out_dir} or "
                         "remove it")
    if os.path.exists(out_dir):
        os.replace(out_dir, earlier)
    os.makedirs(out_dir)
    log_path = os.path.join(out_dir, "train.log")
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        code = subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT).returncode
    wall = time.perf_counter() - t0
    if code != 0:
        with open(log_path) as f:
            last = [line.strip() for line in f if line.strip()][-1:] or ["(no output)"]
        if os.path.exists(earlier):
            os.replace(log_path, f"{out_dir}.failed.log")
            shutil.rmtree(out_dir)
            os.replace(earlier, out_dir)
            log_path = f"{out_dir}.failed.log"
        raise BenchError(f"{shlex.join(cmd)} exited with {code}: {last[0]} (full log: {log_path})")
    shutil.rmtree(earlier, ignore_errors=True)
    for name in os.listdir(out_dir):  # train.py's final checkpoint: the benchmark only needs the metrics
        if name.startswith("ckpt_"):
            os.remove(os.path.join(out_dir, name))
    with open(os.path.join(out_dir, RUN_INFO), "w") as f:
        json.dump({"command": shlex.join(cmd), "settings": settings, "wall_s": wall}, f)
    return wall


# ----------------------------------------------------------------------------- report


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return platform.processor() or platform.machine()


def code_line() -> str:
    """The commit the runs used, and which tracked files differed from it (an honest table names both)."""
    def git(*args):
        return subprocess.run(["git", "-C", REPO, *args], capture_output=True, text=True).stdout.strip()

    commit = git("rev-parse", "--short", "HEAD")
    if not commit:
        return "not a git checkout"
    changed = [line.split(maxsplit=1)[1] for line in git("status", "--porcelain", "--untracked-files=no").splitlines()]
    return f"commit {commit}" + (f", with uncommitted changes to {', '.join(changed)}" if changed else ", clean")


def hardware_line() -> str:
    gpu = f"GPU {torch.cuda.get_device_name()}, " if torch.cuda.is_available() else ""
    return (f"{gpu}CPU {cpu_model()} ({os.cpu_count()} logical CPUs; torch threads per run: {torch.get_num_threads()}), "
            f"torch {torch.__version__}, Python {platform.python_version()}")


def fmt_ratio(tokens: float | None, budget: int) -> str:
    return "not reached" if tokens is None else f"{tokens / budget:.2f} ({tokens:,.0f} tokens)"


def report(a, results, adam_lrs, walls, command, machine, code, loads) -> str:
    """The markdown table and summary. results: optimizer -> {lr: records}."""
    first = next(iter(next(iter(results.values())).values()))
    budget = first[-1]["tokens"]
    tokens_per_step = budget // first[-1]["step"]
    best = {o: best_lr(runs) for o, runs in results.items()}
    target = None
    if "adamw" in results and best["adamw"] is not None:
        target = final_val_loss(results["adamw"][best["adamw"]])

    lines = [
        "# Optimizer sample efficiency",
        "",
        f"- command: `{command}`",
        f"- hardware: {machine}",
        f"- code: {code}",
        f"- load average (1 min) when this invocation started / ended: {loads[0]:.1f} / {loads[1]:.1f} "
        "(a shared machine: tokens/s depend on what else ran)",
        f"- budget: {a.steps} steps x {tokens_per_step:,} tokens = {budget:,} tokens per run; val loss on the same "
        f"{a.eval_tokens:,} val tokens every {a.eval_every} steps; one seed per run",
        "",
        "| optimizer | peak LR | AdamW-side LR | final val loss | best of optimizer | "
        "tokens to reach AdamW's best (ratio to budget) | median tokens/s | wall s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for optimizer, runs in results.items():
        for lr, records in runs.items():
            loss = final_val_loss(records)
            curve = list(zip(*series(records, "val_loss")))
            reach = fmt_ratio(tokens_to_reach(curve, target), budget) if target is not None else "n/a"
            side = "-" if optimizer != "muon" else "= peak LR" if adam_lrs["muon"] is None else f"{adam_lrs['muon']:g}"
            tok_s = statistics.median(r["tokens_per_sec"] for r in records)
            lines.append(f"| {optimizer} | {lr:g} | {side} | {loss:.4f} | {'**yes**' if lr == best[optimizer] else ''} "
                         f"| {reach} | {tok_s:,.0f} | {walls[optimizer][lr]:.0f} |")
    lines.append("")
    for optimizer in results:
        lr = best[optimizer]
        if lr is None:
            lines.append(f"- {optimizer}: every run diverged")
        else:
            lines.append(f"- best final val loss, {optimizer}: {final_val_loss(results[optimizer][lr]):.4f} (LR {lr:g})")
    if target is not None and "muon" in results and best["muon"] is not None:
        curve = list(zip(*series(results["muon"][best["muon"]], "val_loss")))
        reach = tokens_to_reach(curve, target)
        lines.append(f"- tokens Muon (best LR, {best['muon']:g}) needs to reach AdamW's best final val loss "
                     f"{target:.4f}, as a fraction of AdamW's {budget:,}-token budget: {fmt_ratio(reach, budget)} "
                     "(goal: 0.70 or less)")
    lines.append("")
    return "\n".join(lines)


def optimizer_lrs(a, optimizer: str, results: dict) -> tuple[list[float], float | None]:
    """-> (the LRs to sweep for optimizer, Muon's AdamW-side LR or None): adamw8bit and Muon's AdamW side take
    AdamW's best LR unless given, so AdamW runs first."""
    adam_lr = None
    if optimizer == "muon":
        adam_lr = a.muon_adam_lr
        if adam_lr is None and results.get("adamw"):
            adam_lr = best_lr(results["adamw"])
    lrs = {"adamw": a.adamw_lrs, "adamw8bit": a.adamw8bit_lrs, "muon": a.muon_lrs}[optimizer]
    if lrs is None:  # adamw8bit's default
        if not results.get("adamw"):
            raise BenchError("--adamw8bit-lrs is needed when adamw does not run before adamw8bit")
        lrs = [best_lr(results["adamw"])]
    return lrs, adam_lr


def sweep(a, train_argv: list[str]) -> tuple[dict, dict, dict, int]:
    """Every (optimizer, LR) run, or its earlier run under --reuse -> (optimizer -> LR -> metrics records,
    optimizer -> LR -> wall seconds, optimizer -> Muon's AdamW-side LR, how many were reused)."""
    results, walls, adam_lrs, reused = {}, {}, {}, 0
    for optimizer in a.optimizers:
        lrs, adam_lr = optimizer_lrs(a, optimizer, results)
        if optimizer == "muon":
            adam_lrs[optimizer] = adam_lr
        results[optimizer], walls[optimizer] = {}, {}
        for lr in lrs:
            out_dir = os.path.join(a.results_dir, "runs", run_name(optimizer, lr))
            cmd = train_command(a, train_argv, optimizer, lr, adam_lr, out_dir)
            wall = finished_wall(out_dir, cmd, a.steps) if a.reuse else None
            if wall is not None:
                reused += 1
                print(f"[reuse] {run_name(optimizer, lr)}", flush=True)
            else:
                print(f"[run] {shlex.join(cmd)}", flush=True)
                wall = train_once(cmd, out_dir, resolved_settings(cmd))
            records = read_metrics(out_dir)
            results[optimizer][lr], walls[optimizer][lr] = records, wall
            print(f"      final val loss {final_val_loss(records):.4f}, wall {wall:.0f} s", flush=True)
    return results, walls, adam_lrs, reused


def plot_best(results: dict, png_path: str) -> None:
    """The val-loss curve of each optimizer's best LR, zoomed to where the runs separate."""
    best_runs = {f"{o} (LR {best_lr(r):g})": r[best_lr(r)] for o, r in results.items() if best_lr(r) is not None}
    target = None
    if results.get("adamw") and best_lr(results["adamw"]) is not None:
        target = (final_val_loss(results["adamw"][best_lr(results["adamw"])]), "AdamW's best final val loss")
    finals = [final_val_loss(r) for r in best_runs.values()]
    # From just under the best final loss to 1.0 above the worst one.
    ylim = (min(finals) - 0.1, max(finals) + 1.0) if finals else None
    plot_runs(best_runs, png_path, panels=("val_loss",), target=target, loss_ylim=ylim,
              title="validation loss, best LR of each optimizer (zoomed; earlier evals are off the top)")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    # The thread count and priority change tokens/s, so the reproducing command carries them too.
    prefix = [f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}"] if "OMP_NUM_THREADS" in os.environ else []
    prefix += ["nice", "-n", str(os.nice(0))] if os.nice(0) else []
    command = shlex.join([*prefix, "python", "bench/optimizers.py", *argv])
    try:
        a, train_argv = parse_bench_args(argv)
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    loads = [os.getloadavg()[0]]
    machine, code = hardware_line(), code_line()
    t_start = time.perf_counter()
    try:
        results, walls, adam_lrs, reused = sweep(a, train_argv)
    except (BenchError, MetricsError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    loads.append(os.getloadavg()[0])

    table = report(a, results, adam_lrs, walls, command, machine, code, loads)
    total = sum(w for runs in walls.values() for w in runs.values())
    table += (f"\nTraining wall time, summed over the {sum(map(len, walls.values()))} runs: {total:.0f} s "
              f"({reused} reused from an earlier invocation with --reuse); "
              f"this invocation: {time.perf_counter() - t_start:.0f} s.\n")
    os.makedirs(a.results_dir, exist_ok=True)
    md_path, png_path = os.path.join(a.results_dir, "optimizers.md"), os.path.join(a.results_dir, "optimizers.png")
    atomic_write(md_path, table.encode())
    plot_best(results, png_path)
    print()
    print(table)
    print(f"wrote {md_path} and {png_path}")


if __name__ == "__main__":
    run_writing_results(main)
