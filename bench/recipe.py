"""Recipe toggles, measured: each toggle is a few extra train.py flags, run against a baseline at a few token
horizons over seeds, with a GPT-2 + AdamW anchor to count tokens against.

    sh bench/prose_corpus.sh                     # once: the prose corpus (apt-get install linux-doc-6.1)
    python bench/recipe.py [--corpus prose|stdlib] [--max-tokens 65536 131072 262144] [--seeds 1 2 3]
                           [--only wsd,normuon] [--toggle "packing=--packing bos"] [--jobs 2] [--fresh]
                           [--anchor-lrs 3e-4 1e-3 3e-3] [--smoke] [--out bench/results/recipe.md]
                           [any train.py flags]

Every (toggle, horizon, seed) is one `python train.py` run at the bench's shape (4 layers, width 256, seq 256,
micro-batch 16) and precision (fp32: --dtype gives another) on the corpus, trained for exactly the horizon's
tokens, so that each run's schedule ends at its horizon, with --seed as the seed of the initialisation and the data
order. Only the final val loss is evaluated, on the same val tokens for every run (--eval-tokens 32768 unless
given).

The cache (--cache, default bench/results/recipe_cache.json) keeps each run's final val loss, median step time
and parameter count under its corpus id and the whole configuration its train.py flags resolve to (toggle,
horizon and seed among them; a changed default is a new key), so a rerun runs only what is not there. It does not
know the code: after a change to model.py, optim.py or train.py that can move a loss at the same settings, rerun
with --fresh (every run again, its entries replaced).

The table has, per toggle and horizon: the final val loss of each seed, their mean, their spread (max - min), the
mean's delta against the baseline's, and whether |delta| exceeds both the toggle's and the baseline's spread
(with one seed there is no spread, so no verdict); per toggle, the step time (median after the first steps)
relative to the baseline's, and the parameter count.

The anchor: bench/anchor.py, GPT-2's architecture from transformers with AdamW, at the runs' depth, width, heads,
sequence length and global batch, at each of --anchor-lrs for the longest horizon x --anchor-factor tokens, seed 1;
the LR with the lowest final val loss is its tuned LR. Each toggle's "tokens to the anchor's final loss"
interpolates the toggle's mean final loss at its horizons linearly in log(tokens): a run's loss before its
schedule's end is not what a run ending there reaches, so only ends count. The ratio is those tokens over the
anchor's; past the longest horizon it reads "> longest / anchor".

--smoke: the stdlib corpus, a tiny model, horizons 1,024 and 2,048, one seed, two anchor LRs, its own cache (under
the runs' directory): the whole path in a few minutes, train.py's start-up being most of it. A toggle that cannot
apply (a Muon option under --optimizer adamw, the batch warm-up without gradient accumulation), or that only sets
the defaults (wsd), is listed as n/a, with why. --jobs runs that many trainings at once, each with OMP_NUM_THREADS
= CPU cores / jobs.
"""
import argparse
import hashlib
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import config  # noqa: E402
from atomic import atomic_write  # noqa: E402
from batch import batch_layout  # noqa: E402
from cli import DataError, HelpFormatter, UsageError, WriteError, cache_root, out_problem  # noqa: E402
from data import fingerprint, split_paths  # noqa: E402
from docs_corpus import default_dir as docs_dir  # noqa: E402
from optimizers import code_line  # noqa: E402
from recipe_cache import STEP_TIME_SKIP, BenchError, Cache, anchor_key, cache_key, run_result, timing_machine  # noqa
from runlog import MetricsError  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Set by this script for every run; passed through they would make the runs disagree with the table.
OWN_TRAIN_FLAGS = ("--optimizer", "--out-dir", "--seed", "--max-tokens", "--max-steps", "--resume", "--overwrite")
BATCH_FLAGS = ("--batch-size", "--grad-accum", "--total-batch-tokens")
# The bench's shape: what --depth 4 derives (4 layers of width 64 x 4 = 256, heads 4q/2kv), spelled out so that
# the dial's other derivations (LR, batch) stay out of the runs; seq 256, micro-batch 16, no accumulation.
SHAPE = ["--n-layer", "4", "--n-embd", "256", "--n-head", "4", "--n-kv-head", "2", "--seq-len", "256"]
BATCH_DEFAULTS = ["--batch-size", "16", "--grad-accum", "1"]
# Overridable by train.py flags on the command line: evaluate once, at the end; one checkpoint, at the end.
EVAL_DEFAULTS = ["--eval-interval", str(10**9), "--eval-tokens", "32768", "--ckpt-interval", "0"]
# The CPU, at one precision on every machine, so that runs pool across CPUs: train.py's --dtype auto picks bf16
# autocast by a timed probe, which passes on some CPUs with native bf16 and not on others (or not under load). The
# float32 stream is what every cached run had. --dtype bf16 or auto on the command line overrides it: auto is how
# every run cached before this pin was made, so it reads those back. The tables and budgets are the CPU's: a GPU
# (--device auto's choice where there is one) is refused.
MACHINE_DEFAULTS = ["--device", "cpu", "--dtype", "fp32", "--activation-dtype", "fp32"]
HORIZONS = [65536, 131072, 262144]
SEEDS = [1, 2, 3]
ANCHOR_LRS = [3e-4, 1e-3, 3e-3]
# --smoke: the whole path (runs, cache, anchor, ratio) in about a minute on two cores.
SMOKE_SHAPE = ["--n-layer", "2", "--n-embd", "64", "--n-head", "4", "--n-kv-head", "2", "--seq-len", "64",
               "--eval-tokens", "1024"]
SMOKE_BATCH = ["--batch-size", "4", "--grad-accum", "1"]
SMOKE = {"corpus": "stdlib", "max_tokens": [1024, 2048], "seeds": [1], "anchor_lrs": [1e-3, 3e-3]}
BATCH_WARMUP_STEPS = 30  # a fifth of the default budget's 150 steps
# Recipe v4: v5's defaults before it adopted zero-initialised projections, Muon momentum 0.9, a one-step warm-up
# and the AdamW side's beta1 0.7 (docs/recipe.md); v3: v4's model without the look-back
RECIPE_V4 = ["--no-zero-init-proj", "--muon-momentum", "0.95", "--warmup", "3", "--beta1", "0.9"]
RECIPE_V3 = [*RECIPE_V4, "--no-smear", "--bigram-embed", "0"]


# ----------------------------------------------------------------------------- the toggles


def default_toggles(lr: float, side_lr: float) -> dict[str, tuple[list[str], bool]]:
    """name -> (train.py flags, whether it needs --optimizer muon). lr, side_lr: the runs' peak LR and the AdamW
    side's, which the LR toggles scale."""
    return {
        "baseline": ([], False),
        "wsd": (["--schedule", "wsd"], False),
        "zero-init-proj": (["--zero-init-proj"], False),
        "polar-express": (["--ns-coeffs", "polar-express"], True),
        "normuon": (["--normuon"], True),
        "cautious-wd": (["--cautious-wd"], False),
        "batch-warmup": (["--batch-warmup-steps", str(BATCH_WARMUP_STEPS)], False),
        "tied": (["--tie-embeddings"], False),
        # Recipe v2 (docs/recipe.md): architecture, optimizer and schedule toggles for short horizons.
        "softcap": (["--logit-softcap", "15"], False),
        "relu2": (["--mlp", "relu2"], False),
        "value-embeds": (["--value-embeds", "1"], False),
        "unet-skips": (["--unet-skips"], False),
        "no-attn-gate": (["--no-attn-gate"], False),
        "momentum-warmup": (["--muon-momentum-warmup", "10"], True),
        "zero-head": (["--head-init", "zero"], False),
        "embed-beta1": (["--embed-beta1", "0.8"], False),
        "warmup-15": (["--warmup", "15"], False),
        "decay-0.5": (["--decay-frac", "0.5"], False),
        # The defaults before recipe v2 adopted --attn-gate and --warmup 3, before recipe v4 adopted the smear and
        # the bigram table, and before recipe v5 (docs/recipe.md)
        "recipe-v1": ([*RECIPE_V3, "--no-attn-gate", "--warmup", "15"], False),
        "recipe-v3": (RECIPE_V3, False),
        "recipe-v4": (RECIPE_V4, False),
        # From the 2026 speed records (docs/recipe.md): look-backs at the previous token (on by default), the
        # embedding at every block
        "no-smear": (["--no-smear"], False),
        "no-bigram-embed": (["--bigram-embed", "0"], False),
        "embed-skips": (["--embed-skips"], False),
        "batch-8": (["--batch-size", "8"], False),
        "batch-4": (["--batch-size", "4"], False),
        # The runs' LRs (their width's defaults, optim.default_lrs, unless given) x0.5 and x2
        "lr-half": (["--lr", f"{lr / 2:g}", "--adam-lr", f"{side_lr / 2:g}"], False),
        "lr-double": (["--lr", f"{lr * 2:g}", "--adam-lr", f"{side_lr * 2:g}"], False),
    }


def flag_value(argv: list[str], flag: str) -> str | None:
    """The value argv gives `flag` (as `--flag VALUE` or `--flag=VALUE`; the last, as argparse takes it), or None."""
    values = [arg.split("=", 1)[1] if "=" in arg else (argv[i + 1] if i + 1 < len(argv) else "")
              for i, arg in enumerate(argv) if arg.split("=")[0] == flag]
    return values[-1] if values else None


def not_applicable(flags: list[str], muon_only: bool, cfg) -> str | None:
    """Why a toggle cannot run under cfg (the runs' common configuration), or None if it can. A toggle may bring its
    own --grad-accum for a batch warm-up to ramp."""
    if muon_only and cfg.optim.name != "muon":
        return "needs --optimizer muon"
    own = flag_value(flags, "--grad-accum")
    accumulates = (int(own) if own and own.isdigit() else cfg.data.grad_accum) > 1 or cfg.data.total_batch_tokens
    if "--batch-warmup-steps" in flags and not accumulates:
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
    """-> (bench args, train.py flags to pass through). --smoke fills in what the command line left unset."""
    p = _Parser(description=__doc__, formatter_class=HelpFormatter, allow_abbrev=False)
    p.add_argument("--optimizer", default="muon", help="train.py's --optimizer for every run")
    p.add_argument("--corpus", choices=("prose", "docs", "stdlib"),
                   help="prose: bench/prose_corpus.sh's shards; docs: bench/docs_corpus.py's (the standard "
                        "library's docstrings and comments); stdlib: train.py's embedded corpus (its code); a "
                        "--data among the train.py flags instead names its own (default: prose)")
    p.add_argument("--max-tokens", type=int, nargs="+", metavar="TOKENS",
                   help="the horizons: one run each, its schedule ending there (default: 65536 131072 262144)")
    p.add_argument("--seeds", type=int, nargs="+", help="one run per seed per toggle and horizon (default: 1 2 3)")
    p.add_argument("--only", help="comma-separated toggles to run (the baseline runs anyway)")
    p.add_argument("--toggle", type=parse_toggle, action="append", default=[], metavar="NAME=FLAGS",
                   help='another toggle, e.g. "packing=--packing bos" (repeatable)')
    p.add_argument("--jobs", type=int, default=2, help="trainings at once (default: 2)")
    p.add_argument("--anchor-lrs", type=float, nargs="*", metavar="LR",
                   help="the anchor's AdamW LRs; none: no anchor (default: 3e-4 1e-3 3e-3)")
    p.add_argument("--anchor-factor", type=int, default=4, help="the anchor trains for the longest horizon x this")
    p.add_argument("--cache", help="the runs' results (default: bench/results/recipe_cache.json; under --smoke, "
                                   "the runs' directory)")
    p.add_argument("--fresh", action="store_true", help="run everything again, replacing its cache entries")
    p.add_argument("--smoke", action="store_true", help="a tiny model on the stdlib corpus at 2 small horizons")
    p.add_argument("--out", default=os.path.join(REPO, "bench", "results", "recipe.md"),
                   help="the markdown table (default: bench/results/recipe.md)")
    p.add_argument("--runs-dir", help="keep the runs' directories here (default: a temporary directory)")
    a, train_argv = p.parse_known_args(argv)
    defaults = SMOKE if a.smoke else {"corpus": "prose", "max_tokens": HORIZONS, "seeds": SEEDS,
                                      "anchor_lrs": ANCHOR_LRS}
    for key, value in defaults.items():
        if getattr(a, key) is None:
            setattr(a, key, value)
    for flag, value in ("--max-tokens", min(a.max_tokens)), ("--jobs", a.jobs), ("--anchor-factor", a.anchor_factor):
        if value < 1:
            raise BenchError(f"{flag} must be >= 1, got {value}")
    for flag, values in ("--max-tokens", a.max_tokens), ("--seeds", a.seeds):
        if len(set(values)) != len(values):
            raise BenchError(f"{flag} must be distinct, got {' '.join(map(str, values))}")
    a.max_tokens = sorted(a.max_tokens)
    if problem := owned_flag_problem(train_argv):
        raise BenchError(problem)
    for name, flags in a.toggle:
        if problem := owned_flag_problem(flags):
            raise BenchError(f"toggle {name}: {problem}")
    return a, train_argv


def owned_flag_problem(argv: list[str]) -> str | None:
    """What is wrong with train.py flags that would set what this benchmark sets, or train off the CPU."""
    for arg in argv:
        if arg.split("=")[0] in OWN_TRAIN_FLAGS:
            return f"{arg.split('=')[0]} is set by this benchmark; see --help for its own flags"
    if flag_value(argv, "--device") not in (None, "cpu"):
        return "--device: this benchmark trains on the CPU, whose tables and budgets it reports"
    return None


def prose_dir() -> str:
    """Where bench/prose_corpus.sh puts its shards by default."""
    return os.path.join(cache_root(), "bench", "linux-doc-6.1")


# The corpora prepared outside train.py: where each one's shards are, and the command that makes them.
PREPARED_CORPORA = {
    "prose": (prose_dir, "sh bench/prose_corpus.sh (apt-get install linux-doc-6.1, then prepare.py)"),
    "docs": (docs_dir, "python bench/docs_corpus.py (the standard library's docstrings and comments)"),
}


def shards_digest(data: str, named: str = "--data") -> str:
    """A hash of the train and val shards' data.fingerprint: the same text prepared another way, or other text in
    the same directory, is another corpus. named: what an error names the shards by."""
    try:
        shards = fingerprint(split_paths(data, "train") + split_paths(data, "val"))
    except DataError as e:
        raise BenchError(f"{named}: {e}") from None
    return hashlib.sha256(json.dumps(shards).encode()).hexdigest()[:16]


def corpus_of(a, train_argv) -> tuple[list[str], str, str]:
    """-> (the --data flags for the runs, the corpus id the cache keys on, its description for the header).
    The id is the corpus's name (its corpus.json's id, from bench/prose_corpus.sh; the default corpus's
    directory, which names its Python; or else the directory's path) and a hash of its shards'
    data.fingerprint: the same text prepared by another prepare.py (another val split, say) or other text in the
    same directory does not reuse the old runs."""
    data = flag_value(train_argv, "--data")
    if data is None and a.corpus == "stdlib":  # train.py finds it: no --data; its id names Python's version
        import prepare
        try:
            where = prepare.default_corpus()
        except (DataError, OSError) as e:
            raise BenchError(f"the stdlib corpus: {e}") from None
        corpus_id = f"{os.path.basename(where)}@{shards_digest(where, 'the stdlib corpus')}"
        return [], corpus_id, "train.py's embedded stdlib corpus (Python source)"
    where, make = PREPARED_CORPORA[a.corpus]
    flags = [] if data is not None else ["--data", where()]
    data = data or where()
    described = os.path.join(data, "corpus.json")
    if data == where() and not os.path.exists(described):
        raise BenchError(f"{data}: no {a.corpus} corpus there; make it with `{make}`")
    digest = shards_digest(data)
    if os.path.exists(described):
        with open(described) as f:
            record = json.load(f)
        return flags, f"{record['id']}@{digest}", f"{record['corpus']}; made by `{record['made_by']}`"
    return flags, f"{os.path.abspath(data)}@{digest}", f"{data} (shards' fingerprint {digest})"


def precision_text(dtype: str, stream: str) -> str:
    """The header's precision line for the runs' --dtype and --activation-dtype."""
    made = {"fp32": "fp32", "bf16": "bf16 autocast, float32 weights",
            "auto": "each CPU's choice, bf16 autocast where its probe finds bf16 fast and fp32 elsewhere"}
    return (f"train.py's `--dtype {dtype} --activation-dtype {stream}`: {made.get(dtype, dtype + ' autocast')}; "
            "the anchor in fp32")


def common_flags(a, train_argv) -> list[str]:
    """The flags every run shares, toggles and --out-dir / --seed / --max-tokens aside; the bench's defaults come
    first, so the command line's train.py flags override them."""
    shape, batch = (SMOKE_SHAPE, SMOKE_BATCH) if a.smoke else (SHAPE, BATCH_DEFAULTS)
    batch = [] if any(arg.split("=")[0] in BATCH_FLAGS for arg in train_argv) else batch
    return [*EVAL_DEFAULTS, *MACHINE_DEFAULTS, *shape, *batch, *train_argv, "--optimizer", a.optimizer]


def select_toggles(a, cfg) -> dict[str, tuple[list[str], str | None]]:
    """name -> (flags, why it cannot run or None), the baseline first, in the order they are listed."""
    side_lr = cfg.optim.adam_lr if cfg.optim.name == "muon" and cfg.optim.adam_lr is not None else cfg.optim.lr
    toggles = dict(default_toggles(cfg.optim.lr, side_lr))
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


def model_params(flags: list[str]) -> int:
    """The parameter count of train.py's model under flags, built on the meta device (no memory, no time)."""
    import torch

    from model import GPT
    with torch.device("meta"):
        return sum(p.numel() for p in GPT(config.parse_args(flags).model).parameters())


def train_once(cmd: list[str], out_dir: str, threads: int) -> float:
    """One training to completion, its output in out_dir/train.log -> its wall seconds."""
    os.makedirs(out_dir, exist_ok=True)
    log_path = os.path.join(out_dir, "train.log")
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        code = subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env).returncode
    if code != 0:
        with open(log_path) as f:
            last = [line.strip() for line in f if line.strip()][-1:] or ["(no output)"]
        raise BenchError(f"{shlex.join(cmd)} exited with {code}: {last[0]}")
    return time.perf_counter() - t0


def run_all(jobs: list[dict], cache: Cache, fresh: bool, n_jobs: int, threads: int, machine: str) -> dict[str, dict]:
    """jobs: {key, label, cmd, out_dir, params} -> {key: its result}: from the cache, unless fresh, else run, n_jobs
    at a time, each result cached as it finishes, its step time filed under machine (timing_machine)."""

    def one(job):
        print(f"[run] {job['label']}: {shlex.join(job['cmd'])}", flush=True)
        wall = train_once(job["cmd"], job["out_dir"], threads)
        result = {**run_result(job["out_dir"], job["params"], machine), "wall_s": wall}
        cache.put(job["key"], result)
        print(f"      {job['label']}: final val loss {result['val_loss']:.4f}, {wall:.0f} s", flush=True)
        return result

    todo = [job for job in jobs if fresh or job["key"] not in cache.entries]
    print(f"{len(jobs) - len(todo)} of {len(jobs)} runs cached; running {len(todo)}", flush=True)
    pool = ThreadPoolExecutor(max_workers=n_jobs)
    try:
        futures = [pool.submit(one, job) for job in todo]
        for future in futures:
            future.result()
    finally:  # after a failed run, the runs not yet started are not started
        pool.shutdown(cancel_futures=True)
    return {job["key"]: cache.entries[job["key"]] for job in jobs}


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


def tokens_to_reach(horizons: list[int], losses: list[float], target: float) -> tuple[float | None, str]:
    """The tokens at which the final-loss curve through (horizons, losses) first reaches target, interpolated
    linearly in log(tokens) -> (tokens, "") or, outside the horizons, (the first horizon, "<=") when even it is
    at or below target and (None, ">") when none reaches it."""
    if losses[0] <= target:
        return float(horizons[0]), "<="
    for (t0, l0), (t1, l1) in zip(zip(horizons, losses), zip(horizons[1:], losses[1:])):
        if l1 <= target:
            frac = (l0 - target) / (l0 - l1)
            return math.exp(math.log(t0) + frac * (math.log(t1) - math.log(t0))), ""
    return None, ">"


def ratio_text(horizons: list[int], losses: list[float], target: float, anchor_tokens: int) -> str:
    tokens, bound = tokens_to_reach(horizons, losses, target)
    if tokens is None:
        return f"> {horizons[-1] / anchor_tokens:.3f} (not reached by {horizons[-1]:,} tokens)"
    return f"{bound + ' ' if bound else ''}{tokens / anchor_tokens:.3f} ({tokens:,.0f} tokens)"


def verdict_text(verdict: bool | None) -> str:
    return {None: "-", True: "**yes**", False: "no"}[verdict]


def step_ratio(times: dict[str, list[float]], base_times: dict[str, list[float]], here: str,
               step_tokens: float = 1.0) -> tuple[float | None, str | None, float | None]:
    """A toggle's step time against the baseline's on one CPU -> (per-token ratio, that CPU, the toggle's median
    step seconds), or (None, None, None) with no CPU both were timed on. times, base_times: CPU -> step times of
    the runs measured on it. The CPU is this machine's if both have runs on it, else the one most of the
    toggle's runs were timed on that the baseline's were too; losses pool across CPUs, times do not.
    step_tokens: the toggle's tokens per step over the baseline's, so a smaller batch is not counted as faster."""
    shared = [cpu for cpu in times if cpu in base_times]
    if not shared:
        return None, None, None
    cpu = here if here in shared else max(shared, key=lambda c: len(times[c]))
    toggle, base = statistics.median(times[cpu]), statistics.median(base_times[cpu])
    return toggle / base / step_tokens, cpu, toggle


def step_cost(times: dict[str, list[float]], base_times: dict[str, list[float]], here: str,
              step_tokens: float = 1.0) -> str:
    """step_ratio as the table's text."""
    ratio, cpu, seconds = step_ratio(times, base_times, here, step_tokens)
    if ratio is None:
        return f"n/a (no baseline run timed on {', '.join(times) or 'any CPU'})"
    notes = ("" if step_tokens == 1 else " per token") + ("" if cpu == here else f", on {cpu}")
    return f"{seconds * 1000:,.0f} ms ({ratio:.2f}x{notes})"


def results_record(corpus: str, selected: dict, losses: dict, horizons: list[int], step_s: dict,
                   step_tokens: dict, here: str) -> dict:
    """What bench/recipe_verdict.py reads of a table (written beside it as .json): each runnable toggle's flags,
    per-seed final losses by horizon and per-token step cost against the baseline."""
    toggles = {}
    for name, (flags, why) in selected.items():
        if why is None:
            ratio = step_ratio(step_s[name], step_s["baseline"], here,
                               step_tokens[name] / step_tokens["baseline"])[0]
            toggles[name] = {"flags": flags, "losses": {str(h): losses[name, h] for h in horizons},
                             "step_cost": ratio}
    return {"corpus": corpus, "horizons": horizons, "toggles": toggles}


def toggle_table(selected: dict, losses: dict, horizons: list[int], step_s: dict, params: dict,
                 step_tokens: dict, here: str) -> list[str]:
    """losses: (toggle, horizon) -> per-seed final val losses; step_s: toggle -> CPU -> its runs' median step
    seconds; params, step_tokens: toggle -> parameter count, tokens per step; here: this machine's
    timing_machine. One row per toggle and horizon, the n/a toggles once."""
    lines = ["| toggle | flags | horizon | final val loss per seed | mean | spread | delta vs baseline | "
             "beyond both spreads | step time vs baseline | params |", "|---|---|---|---|---|---|---|---|---|---|"]
    rows = {h: summarize({name: losses[name, h] for name, (_, why) in selected.items() if why is None})
            for h in horizons}
    for name, (flags, why) in selected.items():
        shown = f"`{shlex.join(flags)}`" if flags else "(none)"
        if why is not None:
            lines.append(f"| {name} | {shown} | | n/a: {why} | | | | | | |")
            continue
        cost = step_cost(step_s[name], step_s["baseline"], here, step_tokens[name] / step_tokens["baseline"])
        for h in horizons:
            r = rows[h][name]
            delta = "-" if name == "baseline" else f"{r['delta']:+.4f}"
            per_seed = ", ".join(f"{v:.4f}" for v in losses[name, h])
            lines.append(f"| {name} | {shown} | {h:,} | {per_seed} | {r['mean']:.4f} | {r['spread']:.4f} | {delta} | "
                         f"{verdict_text(r['beyond_noise'])} | {cost} | {params[name]:,} |")
    return lines


def anchor_jobs(a, cfg, corpus: str, data: str | None, runs_dir: str) -> list[dict]:
    """The anchor's runs, one per LR, on the runs' shards (the stdlib corpus: its cached shards), at the shape and
    batch of cfg, the runs' config: a --n-embd 512 sweep is measured against a width-512 anchor. The runs' global
    batch (--batch-size x --grad-accum, or --total-batch-tokens) is the anchor's --batch-size, so both take as
    many optimizer steps."""
    if data is None:
        import prepare
        data = prepare.default_corpus()
    batch = batch_layout(cfg).sequences_per_rank  # one process: the global batch
    shape = ["--n-layer", str(cfg.model.n_layer), "--n-embd", str(cfg.model.n_embd), "--n-head",
             str(cfg.model.n_head), "--seq-len", str(cfg.model.max_seq_len), "--batch-size", str(batch),
             "--eval-tokens", str(cfg.eval.eval_tokens)]
    tokens = a.max_tokens[-1] * a.anchor_factor
    interval = max(1, tokens // (batch * cfg.model.max_seq_len) // 16)  # 16 points on its curve
    jobs = []
    for lr in a.anchor_lrs:
        flags = [*shape, "--lr", f"{lr:g}", "--max-tokens", str(tokens), "--eval-interval", str(interval), "--seed", "1"]
        out_dir = os.path.join(runs_dir, f"anchor_lr{lr:g}")
        jobs.append({"key": anchor_key(corpus, flags), "label": f"anchor, lr {lr:g}", "out_dir": out_dir,
                     "cmd": [sys.executable, os.path.join(REPO, "bench", "anchor.py"), "--data", data, *flags,
                             "--out-dir", out_dir], "params": None, "lr": lr})
    return jobs


def anchor_lines(jobs: list[dict], results: dict, selected: dict, losses: dict, horizons: list[int]) -> list[str]:
    """The anchor's LR sweep, its tuned LR and each toggle's tokens-to-the-anchor's-loss ratio."""
    sweep = {job["lr"]: results[job["key"]] for job in jobs}
    best_lr = min(sweep, key=lambda lr: sweep[lr]["val_loss"])
    best = sweep[best_lr]
    lines = ["", "## The anchor: GPT-2 (transformers' GPT2LMHeadModel) + AdamW", "",
             "| AdamW LR | final val loss | tokens | step time | params |", "|---|---|---|---|---|"]
    for lr, r in sweep.items():
        mark = " (tuned)" if lr == best_lr else ""
        lines.append(f"| {lr:g}{mark} | {r['val_loss']:.4f} | {r['tokens']:,} | {r['step_s'] * 1000:,.0f} ms | "
                     f"{r['params']:,} |")
    curve = ", ".join(f"{t:,}: {v:.3f}" for t, v in best["curve"])
    lines += ["", f"The tuned anchor's val loss over tokens: {curve}.", "",
              f"## Tokens for ours to reach the anchor's final loss ({best['val_loss']:.4f} at {best['tokens']:,} "
              "tokens)", "", "Each toggle's mean final loss at its horizons, interpolated in log(tokens); the ratio "
              "is those tokens over the anchor's.", "", "| toggle | ratio |", "|---|---|"]
    for name, (_, why) in selected.items():
        if why is None:
            means = [statistics.fmean(losses[name, h]) for h in horizons]
            lines.append(f"| {name} | {ratio_text(horizons, means, best['val_loss'], best['tokens'])} |")
    return lines


def without_no_ops(selected: dict, flags: list[str]) -> dict:
    """selected with each toggle whose flags leave the runs' configuration as the baseline's (it sets what is
    already the default, as --schedule wsd does) marked n/a: it would only repeat the baseline's runs."""
    baseline = config.parse_args(flags)

    def no_op(name: str, toggle_flags: list[str]) -> bool:
        return name != "baseline" and config.parse_args([*flags, *toggle_flags]) == baseline

    return {name: (toggle_flags, why or ("the baseline's configuration already (its flags set the defaults)"
                                         if no_op(name, toggle_flags) else None))
            for name, (toggle_flags, why) in selected.items()}


def toggle_sizes(selected: dict, flags: list[str]) -> tuple[dict, dict]:
    """The runnable toggles' parameter counts and tokens per step, their flags checked as train.py's start-up
    checks them, before any run starts; BenchError names the toggle whose flags train.py refuses."""
    params, step_tokens = {}, {}
    for name, (toggle_flags, why) in selected.items():
        if why is None:
            try:
                toggle_cfg = config.parse_args([*flags, *toggle_flags])  # optim.py's checks among train.py's
                params[name] = model_params([*flags, *toggle_flags])
            except (UsageError, ValueError) as e:
                raise BenchError(f"toggle {name} ({shlex.join(toggle_flags)}): {e}") from None
            step_tokens[name] = batch_layout(toggle_cfg).tokens_per_step
    return params, step_tokens


class Plan(NamedTuple):
    """A checked invocation: what every run of it shares and which toggles it runs."""
    args: argparse.Namespace  # the bench's own flags
    train_argv: list[str]  # the train.py flags given on its command line
    flags: list[str]  # the train.py flags every run shares, --data among them
    data_flags: list[str]  # the corpus's --data, when the bench names it
    corpus: str  # the corpus's cache id
    corpus_text: str  # and its description for the header
    selected: dict  # toggle name -> (its flags, why it does not apply or None)
    params: dict  # toggle name -> parameter count
    step_tokens: dict  # toggle name -> tokens per optimizer step
    cfg: object  # train.py's config at the first horizon, toggles aside


def plan(argv: list[str]) -> Plan:
    """Every check an invocation needs, done before any run starts."""
    a, train_argv = parse_bench_args(argv)
    record = os.path.splitext(a.out)[0] + ".json"  # the table's record, for bench/recipe_verdict.py
    if problem := out_problem(a.out, makes_folder=True):  # before any run, not after the sweep's hours
        raise BenchError(problem)
    if record == a.out:
        raise BenchError(f"--out {a.out}: the table's record is written beside it as .json; name the table .md")
    if os.path.isdir(record):
        raise BenchError(f"--out {a.out}: a directory at {record}, where the table's record is to be written")
    data_flags, corpus, corpus_text = corpus_of(a, train_argv)
    flags = [*common_flags(a, train_argv), *data_flags]
    cfg = config.parse_args([*flags, "--max-tokens", str(a.max_tokens[0])])
    selected = select_toggles(a, cfg)
    params, step_tokens = toggle_sizes(selected, flags)
    selected = without_no_ops(selected, flags)
    if a.max_tokens[0] < max(step_tokens.values(), default=0):  # train.py would round up to a whole step
        raise BenchError(f"--max-tokens {a.max_tokens[0]:,} is less than one step's "
                         f"{max(step_tokens.values()):,} tokens")
    return Plan(a, train_argv, flags, data_flags, corpus, corpus_text, selected, params, step_tokens, cfg)


def toggle_jobs(a, flags: list[str], corpus: str, selected: dict, params: dict, runs_dir: str) -> list[dict]:
    """One train.py run per (toggle, horizon, seed), each with its cache key and its own output directory."""
    jobs = []
    for name, (toggle_flags, why) in selected.items():
        for h in a.max_tokens if why is None else []:
            for seed in a.seeds:
                run_flags = [*flags, *toggle_flags, "--max-tokens", str(h), "--seed", str(seed)]
                out_dir = os.path.join(runs_dir, f"{name}_{h}_seed{seed}")
                jobs.append({"key": cache_key(corpus, run_flags), "label": f"{name}, {h:,} tokens, seed {seed}",
                             "name": name, "horizon": h, "out_dir": out_dir, "params": params[name],
                             # --overwrite: a --runs-dir may hold an earlier invocation's runs
                             "cmd": [sys.executable, os.path.join(REPO, "train.py"), *run_flags, "--out-dir",
                                     out_dir, "--overwrite"]})
    return jobs


def report_header(command: str, p: Plan, machine: tuple, n_runs: int, run_walls: float,
                  seconds: float) -> list[str]:
    """The results file's header: how to make it again, on what, at what cost. machine: (CPU, cores, threads)."""
    a, flags, here, (cores, threads) = p.args, p.flags, machine[0], machine[1:]
    return ["# Recipe toggles", "", f"- command: `{command}`",
            f"- corpus: {p.corpus_text} (cache id `{p.corpus}`)",
            f"- common train.py flags: `{shlex.join(flags)}`; horizons {', '.join(f'{h:,}' for h in a.max_tokens)} "
            f"tokens (`--max-tokens`, each its own run); seeds {', '.join(map(str, a.seeds))}",
            f"- machine: CPU {here}, {cores} cores, shared with other work; {a.jobs} run(s) at once with "
            f"OMP_NUM_THREADS={threads}; not measured on a GPU",
            f"- code: {code_line()}",
            f"- time: {n_runs} runs, {run_walls / 3600:.2f} h of run wall time in all (about "
            f"{run_walls / a.jobs / 3600:.2f} h at {a.jobs} at once); this invocation {seconds:,.0f} s",
            "- noise: a delta counts (**yes**) only when it exceeds both the toggle's and the baseline's spread "
            "over seeds; step time: the median over the toggle's runs of each run's median step (after its first "
            f"{STEP_TIME_SKIP}), against the baseline's on the same CPU (this machine's unless named); final "
            "losses pool runs from different CPUs",
            f"- precision: {precision_text(p.cfg.speed.dtype, p.cfg.speed.activation_dtype)}", ""]


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    command = shlex.join(["python", "bench/recipe.py", *argv])
    started = time.perf_counter()
    try:
        p = plan(argv)
    except (BenchError, UsageError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    a = p.args
    threads = max(1, cores // a.jobs)
    here = timing_machine(threads)
    with tempfile.TemporaryDirectory(prefix="recipe_") as tmp:
        runs_dir = a.runs_dir or tmp
        cache_path = a.cache or (os.path.join(runs_dir, "recipe_cache.json") if a.smoke else
                                 os.path.join(REPO, "bench", "results", "recipe_cache.json"))
        jobs = toggle_jobs(a, p.flags, p.corpus, p.selected, p.params, runs_dir)
        data = p.data_flags[1] if p.data_flags else flag_value(p.train_argv, "--data")
        anchors = anchor_jobs(a, p.cfg, p.corpus, data, runs_dir) if a.anchor_lrs else []
        try:
            # The anchor's runs first: the longest, they would otherwise finish alone after the rest
            results = run_all(anchors + jobs, Cache(cache_path), a.fresh, a.jobs, threads, here)
        except (BenchError, MetricsError) as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)
    losses, step_s = {}, {name: {} for name in p.params}
    for job in jobs:
        losses.setdefault((job["name"], job["horizon"]), []).append(results[job["key"]]["val_loss"])
        for cpu, seconds in results[job["key"]].get("step_s_on", {}).items():
            step_s[job["name"]].setdefault(cpu, []).append(seconds)
    run_walls = sum(results[job["key"]]["wall_s"] for job in jobs + anchors)
    lines = report_header(command, p, (here, cores, threads), len(jobs) + len(anchors), run_walls,
                          time.perf_counter() - started)
    lines += toggle_table(p.selected, losses, a.max_tokens, step_s, p.params, p.step_tokens, here)
    if anchors:
        lines += anchor_lines(anchors, results, p.selected, losses, a.max_tokens)
    report = "\n".join(lines) + "\n"
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    record = results_record(p.corpus, p.selected, losses, a.max_tokens, step_s, p.step_tokens, here)
    try:
        atomic_write(a.out, report.encode())
        atomic_write(os.path.splitext(a.out)[0] + ".json", json.dumps(record, indent=1).encode())  # recipe_verdict's
    except WriteError as e:  # a full disk, say: the runs are in the cache, so a rerun with room only writes
        print(f"error: {e}; the runs are cached: run the same command again once there is room", file=sys.stderr)
        sys.exit(2)
    print()
    print(report)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
