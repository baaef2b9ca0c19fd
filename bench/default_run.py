"""The default run (`python train.py`, no flags) across git revisions: steady-state tokens/s and the share of
wall time spent in the kernel (system time), measured interleaved so that all revisions see the same machine.

    python bench/default_run.py [--revs 648b5b0,026f3bf --rounds 3 --short 4 --long 24] [--flags "--dtype fp32"]

Each revision runs from a detached git worktree (this tree runs as it is, uncommitted changes included) as
`python train.py --max-steps N --eval-interval 0 --out-dir TMP`, once untimed (it prepares the default corpus
and warms the file cache), then in each round a short and a long run, revisions interleaved; --flags adds train.py flags to every run (--dtype fp32: the default run of a CPU
without native bf16, on one that has it). The steady state
is the difference between the two: tokens/s = (long - short) steps x tokens per step / (long - short) wall
seconds, and the system share = the difference in system time over the difference in wall time, so start-up,
the final evaluation and the checkpoint cancel out. The table gives the median over rounds, each revision's
tokens/s against the first revision's and against the previous one's, and the precision its runs resolved
--dtype to (their summary.json's; revisions before it was recorded say so): --dtype auto times a bf16 probe on a
CPU, so two revisions can differ in precision as well as in code.
"""

import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
import hardware  # noqa: E402
from cli import HelpFormatter, ScriptParser  # noqa: E402

def timed_run(tree: str, steps: int, scratch: str, flags: list[str]) -> tuple[float, float, int, str]:
    """-> (wall seconds, system seconds, tokens trained, precision) of one train.py run of `steps` steps in
    `tree`; the tokens from its summary.json, whatever batch --flags gives, and the precision --dtype resolved to
    (a revision whose summary.json does not record it: "not recorded")."""
    out_dir = tempfile.mkdtemp(dir=scratch)
    command = [sys.executable, "train.py", "--max-steps", str(steps), "--eval-interval", "0", "--out-dir", out_dir,
               *flags]
    t0 = time.perf_counter()
    child = subprocess.Popen(command, cwd=tree, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _, status, usage = os.wait4(child.pid, 0)
    wall = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status) != 0:  # its own one-line error (a bad --flags), or a traceback's last line
        last = (child.stderr.read().strip().splitlines() or ["no message"])[-1].removeprefix("error: ")
        print(f"error: {tree}: train.py failed: {last}", file=sys.stderr)
        sys.exit(2)
    with open(os.path.join(out_dir, "summary.json")) as f:
        facts = json.load(f)["facts"]
    return wall, usage.ru_stime, facts["tokens"], decision(facts.get("precision"))


def decision(precision: str | None) -> str:
    """What a run's precision row decided, without the bf16 probe's measured rate, which differs run to run:
    "fp32", "bf16 autocast", "bf16 autocast, bf16 stream"; "not recorded" where the revision did not record it."""
    if not precision:
        return "not recorded"
    return hardware.precision_name(precision) + (", bf16 stream" if "bf16 end to end" in precision else "")


def worktree(rev: str, scratch: str) -> str:
    if rev == "this tree":
        return REPO
    path = os.path.join(scratch, rev)
    subprocess.run(["git", "worktree", "add", "--detach", path, rev], cwd=REPO, check=True, capture_output=True)
    return path


def measure(trees: dict[str, str], rounds: int, short: int, long: int, scratch: str,
            flags: list[str]) -> dict[str, list[tuple]]:
    for tree in trees.values():
        timed_run(tree, short, scratch, flags)  # untimed: corpus preparation, caches
    samples = {rev: [] for rev in trees}
    for _ in range(rounds):
        for rev, tree in trees.items():
            wall_short, sys_short, tokens_short, precision_short = timed_run(tree, short, scratch, flags)
            wall_long, sys_long, tokens_long, precision_long = timed_run(tree, long, scratch, flags)
            wall, system = wall_long - wall_short, sys_long - sys_short
            samples[rev].append(((tokens_long - tokens_short) / wall, system / wall, wall_long,
                                 (precision_short, precision_long)))
    return samples


def table(samples: dict[str, list[tuple]]) -> str:
    lines = ["| revision | tokens/s (steady state) | vs first | vs previous | system time / wall time "
             "| long run's wall time | precision |", "|---|---|---|---|---|---|---|"]
    first = previous = None
    for rev, rows in samples.items():
        tps = statistics.median(r[0] for r in rows)
        share = statistics.median(r[1] for r in rows)
        wall = statistics.median(r[2] for r in rows)
        first = first or tps
        vs_previous = f"{tps / previous:.2f}x" if previous else "-"
        # one, unless the probe decided otherwise in some run (then that revision's rounds mix precisions)
        precisions = " / ".join(dict.fromkeys(p for r in rows for p in r[3]))
        lines.append(f"| {rev} | {tps:,.0f} | {tps / first:.2f}x | {vs_previous} | {100 * share:.0f}% | {wall:.1f} s "
                     f"| {precisions} |")
        previous = tps
    return "\n".join(lines)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    p = ScriptParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--revs", default="648b5b0,026f3bf", help="git revisions before this tree, oldest first")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the table reports their median")
    p.add_argument("--short", type=int, default=4, help="steps of the short run")
    p.add_argument("--long", type=int, default=24, help="steps of the long run")
    p.add_argument("--flags", default="", help="train.py flags for every run, as one string (e.g. \"--dtype "
                                               "fp32\"; one flag alone: --flags=--tie-embeddings)")
    args = p.parse_args(argv)
    if args.rounds < 1 or not 1 <= args.short < args.long:
        p.error("--rounds must be >= 1, and 1 <= --short < --long")
    for rev in (r for r in args.revs.split(",") if r):
        if subprocess.run(["git", "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"], cwd=REPO,
                          capture_output=True).returncode:
            p.error(f"--revs: {rev} is not a git revision here")
    with tempfile.TemporaryDirectory() as scratch:
        revs = [r for r in args.revs.split(",") if r] + ["this tree"]
        trees = {rev: worktree(rev, scratch) for rev in revs}
        try:
            samples = measure(trees, args.rounds, args.short, args.long, scratch, shlex.split(args.flags))
        finally:
            for rev, tree in trees.items():
                if tree != REPO:
                    subprocess.run(["git", "worktree", "remove", "--force", tree], cwd=REPO, capture_output=True)
    print(f"Command: `python bench/default_run.py {shlex.join(argv)}` (CPU: {hardware.cpu_name()}; median of "
          f"{args.rounds} interleaved rounds of {args.long} - {args.short} steps)\n")
    print(table(samples))


if __name__ == "__main__":
    main()
