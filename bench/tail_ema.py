"""A tail EMA of the weights, screened before it is built into training: the val loss of an exponential moving
average of the last steps' weights, against the last weights'.

    python bench/tail_ema.py [--corpus prose|docs] [--max-tokens 131072] [--seeds 1] [--starts 0.5 0.67 0.8]
                             [--decays 0.5 0.75 0.9] [--out bench/results/tail_ema.md] [train.py flags]

Each seed is one train.py run at bench/recipe.py's shape and common flags that writes a checkpoint after every
step (--ckpt-interval 1, the last ones kept). The EMA that starts at step s (each --starts fraction of the run's
steps, rounded) is the weights after step s, then decay x EMA + (1 - decay) x the weights after each later step.
Each EMA is evaluated on the val windows the run's own final eval read (evaluation.Evaluator, the same
micro-batch), beside the last weights, whose loss must be the run's logged final val loss: that check is what
makes the deltas comparable. The run's LR schedule is untouched, so this is the EMA on top of its decay, and it
costs training nothing but the copy and the update of each step after s. Not measured on a GPU.
"""

import contextlib
import os
import shlex
import sys
import tempfile
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from atomic import atomic_write  # noqa: E402
import config  # noqa: E402
import recipe  # noqa: E402
from batch import batch_layout, max_steps  # noqa: E402
from checkpoint import checkpoint_step, list_checkpoints  # noqa: E402
from cli import HelpFormatter, ScriptParser, UsageError, out_problem, run_writing_results  # noqa: E402
from curves import read_metrics  # noqa: E402
from distributed import DistInfo  # noqa: E402
from evaluation import Evaluator  # noqa: E402
from model import GPT  # noqa: E402
from optimizers import code_line, cpu_model  # noqa: E402
from runlog import MetricsError  # noqa: E402
from trained import read_checkpoint  # noqa: E402

# The last weights' loss, evaluated here, against the run's logged one: the same weights and windows in fp32, but
# train.py sizes its loss chunks from the machine's memory, so sums run in another order (measured: 1.1e-4 at
# 4.64); other windows would differ by about 1e-2.
SAME_LOSS = 1e-3


def parse_args(argv):
    p = ScriptParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--corpus", choices=("prose", "docs"), default="prose", help="as bench/recipe.py's")
    p.add_argument("--max-tokens", type=int, default=131072, help="the run's horizon")
    p.add_argument("--seeds", type=int, nargs="+", default=[1], help="one run each")
    p.add_argument("--starts", type=float, nargs="+", default=[0.5, 0.67, 0.8],
                   help="where each EMA starts, as fractions of the run's steps")
    p.add_argument("--decays", type=float, nargs="+", default=[0.5, 0.75, 0.9], help="each EMA's decay per step")
    p.add_argument("--out", default=os.path.join(REPO, "bench", "results", "tail_ema.md"), help="the table")
    a, train_argv = p.parse_known_args(argv)
    if not all(0 < s < 1 for s in a.starts) or not all(0 < d < 1 for d in a.decays):
        raise recipe.BenchError("--starts and --decays must be in (0, 1)")
    if problem := out_problem(a.out, makes_folder=True):
        raise recipe.BenchError(problem)
    a.optimizer, a.smoke = "muon", False  # what bench/recipe.py's common_flags reads
    return a, train_argv


def emas_of(paths: list[str], starts: list[int], decays: list[float]) -> tuple[dict, dict]:
    """Checkpoints in step order -> ({(start step, decay): EMA weights}, the last weights), one checkpoint in
    memory at a time."""
    emas, weights = {}, None
    for path in paths:
        step = checkpoint_step(path)
        _, weights = read_checkpoint(path)
        for start in starts:
            for decay in decays:
                if step == start:
                    emas[start, decay] = {k: v.detach().clone().float() for k, v in weights.items()}
                elif step > start:
                    for k, v in emas[start, decay].items():
                        v.mul_(decay).add_(weights[k].float(), alpha=1 - decay)
    return emas, weights


def val_loss(cfg, data: str, weights: dict) -> float:
    """The val loss of these weights on the windows train.py's final eval of this run read."""
    model = GPT(cfg.model)
    model.load_state_dict(weights)
    evaluator = Evaluator(cfg.eval, data, DistInfo(), torch.device("cpu"), cfg.model.vocab_size, seed=cfg.data.seed)
    micro_batch = batch_layout(cfg).micro_batch
    evaluator.check_val(micro_batch, cfg.model.max_seq_len)
    return evaluator.val_metrics(model, model, contextlib.nullcontext, micro_batch, cfg.model.max_seq_len)["val_loss"]


def one_seed(a, flags: list[str], data: str, seed: int, steps: int, runs_dir: str) -> list[tuple]:
    """One run of `steps` optimizer steps -> rows (seed, start step, decay, EMA loss, last weights' loss)."""
    cfg = config.parse_args([*flags, "--max-tokens", str(a.max_tokens), "--seed", str(seed)])
    starts = sorted({max(1, round(s * steps)) for s in a.starts})
    out_dir = os.path.join(runs_dir, f"seed{seed}")
    cmd = [sys.executable, os.path.join(REPO, "train.py"), *flags, "--max-tokens", str(a.max_tokens), "--seed",
           str(seed), "--ckpt-interval", "1", "--keep-ckpts", str(steps - starts[0] + 1), "--out-dir", out_dir]
    print(f"[run] seed {seed}: {shlex.join(cmd)}", flush=True)
    recipe.train_once(cmd, out_dir, os.cpu_count())
    logged = read_metrics(out_dir)[-1]["val_loss"]
    emas, last = emas_of(list_checkpoints(out_dir), starts, a.decays)
    final = val_loss(cfg, data, last)
    if abs(final - logged) > SAME_LOSS:
        raise recipe.BenchError(f"seed {seed}: the last weights evaluate to {final:.5f}, the run logged {logged:.5f}")
    return [(seed, start, decay, val_loss(cfg, data, ema), final) for (start, decay), ema in emas.items()]


def table(rows: list[tuple], steps: int) -> list[str]:
    lines = ["| seed | EMA from step | decay | val loss of the EMA | of the last weights | delta |",
             "|---|---|---|---|---|---|"]
    for seed, start, decay, ema, final in rows:
        lines.append(f"| {seed} | {start} of {steps} | {decay:g} | {ema:.4f} | {final:.4f} | {ema - final:+.4f} |")
    return lines


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    started = time.perf_counter()
    try:
        a, train_argv = parse_args(argv)
        data_flags, _, corpus_text = recipe.corpus_of(a, train_argv)
        flags = [*recipe.common_flags(a, train_argv), *data_flags]
        cfg = config.parse_args([*flags, "--max-tokens", str(a.max_tokens)])
        data, steps = cfg.data.data, max_steps(cfg, batch_layout(cfg))  # the seed changes neither
        with tempfile.TemporaryDirectory(prefix="tail_ema_") as runs_dir:
            rows = [row for seed in a.seeds for row in one_seed(a, flags, data, seed, steps, runs_dir)]
    except (recipe.BenchError, MetricsError, UsageError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    lines = ["# A tail EMA of the weights, evaluated", "",
             f"- command: `{shlex.join(['python', 'bench/tail_ema.py', *argv])}`", f"- corpus: {corpus_text}",
             f"- train.py flags: `{shlex.join(flags)} --max-tokens {a.max_tokens}`",
             f"- machine: CPU {cpu_model()}, {os.cpu_count()} cores; not measured on a GPU",
             f"- code: {code_line()}; this invocation {time.perf_counter() - started:,.0f} s", "",
             *table(rows, steps)]
    report = "\n".join(lines) + "\n"
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    atomic_write(a.out, report.encode())
    print(report)


if __name__ == "__main__":
    run_writing_results(main)
