"""The recipe's adoption rule across corpora: a toggle is adopted only where it wins on every corpus.

    python bench/recipe_verdict.py bench/results/recipe_prose.json bench/results/recipe_docs.json [--out V.md]

Each input is the .json that bench/recipe.py writes beside its table (one corpus at one shape: its toggles'
per-seed final val losses by horizon and their step cost); a corpus may come in several (two widths, say). A
toggle wins at a horizon when its mean loss is below the baseline's by more than both seed spreads (recipe.py's
"beyond both spreads", in the right direction). It is adopted when the inputs are of two corpora or more and,
in every input, it wins at two thirds of the horizons or more (2 of 3) and its step costs at most
MAX_STEP_COST of the baseline's. A toggle of SAME_WORK_FLAGS alone (LRs, the schedule, an init) runs the very kernels
its baseline does, so its step costs the same by construction: its measured ratio, which other work on the
machine moves by more than 10%, is shown and not held against it. A toggle that holds on some corpora only is
reported as holding there, and not adopted: a rule tuned on one kind of text is not a default for another.

--step-cost NAME=RATIO gives a toggle's time a token against the baseline's as measured side by side on an
otherwise idle machine (bench/throughput.py, one thread each): it replaces, on every corpus, the ratio of
recipe.py's runs, whose step times other work on the machine moves by far more than 10%.
"""

import argparse
import json
import math
import os
import shlex
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from atomic import atomic_write  # noqa: E402
from cli import HelpFormatter, ScriptParser, out_problem, run_writing_results  # noqa: E402

MAX_STEP_COST = 1.10  # a toggle may cost at most 10% more time a token than the baseline
# Flags that change only the scalars a step uses (its LRs, Muon's momentum, the schedule's shape) or the values
# the weights start from, never its work.
SAME_WORK_FLAGS = {"--lr", "--adam-lr", "--embed-lr", "--head-lr", "--warmup", "--decay-frac", "--min-lr-ratio",
                   "--schedule", "--weight-decay", "--muon-momentum", "--muon-momentum-warmup",
                   "--muon-momentum-start", "--beta1", "--beta2", "--embed-beta1", "--embed-beta2", "--zero-init-proj",
                   "--head-init"}


def same_work(flags: list[str]) -> bool:
    """Whether a toggle's flags (as `--flag value` pairs) are all SAME_WORK_FLAGS."""
    names = [f.split("=", 1)[0] for f in flags if f.startswith("--")]
    return bool(names) and all(n in SAME_WORK_FLAGS for n in names)


def wins(record: dict, name: str) -> list[int]:
    """The horizons at which toggle `name` beats the baseline beyond both seed spreads (two seeds or more)."""
    won = []
    for h in record["horizons"]:
        base, toggle = record["toggles"]["baseline"]["losses"][str(h)], record["toggles"][name]["losses"][str(h)]
        if len(base) < 2 or len(toggle) < 2:
            continue
        delta = statistics.fmean(toggle) - statistics.fmean(base)
        if delta < 0 and -delta > max(max(base) - min(base), max(toggle) - min(toggle)):
            won.append(h)
    return won


def holds(record: dict, name: str) -> bool:
    """Whether the toggle wins at two thirds of the corpus's horizons or more, within the step cost."""
    needed = math.ceil(2 * len(record["horizons"]) / 3)
    toggle = record["toggles"][name]
    cheap = same_work(toggle["flags"]) or (toggle["step_cost"] is not None and toggle["step_cost"] <= MAX_STEP_COST)
    return len(wins(record, name)) >= needed and cheap


def verdict(records: list[dict], name: str) -> str:
    """"adopt" where the toggle holds on every record and the records are of two corpora or more; else the
    corpora on whose every record it holds, or "no". A corpus may have several records (two widths, say): each
    must hold, so a corpus given twice never stands in for another."""
    corpora = list(dict.fromkeys(r["corpus"] for r in records))
    held = [c for c in corpora if all(name in r["toggles"] and holds(r, name) for r in records if r["corpus"] == c)]
    if len(held) == len(corpora) >= 2:
        return "**adopt**"
    return f"holds on {', '.join(held)} only: not adopted" if held else "no"


def table(records: list[dict]) -> list[str]:
    names = [n for n in records[0]["toggles"] if n != "baseline" and all(n in r["toggles"] for r in records)]
    corpora = [r["corpus"] for r in records]
    titles = [c + (f" ({r['file']})" if corpora.count(c) > 1 and "file" in r else "") for c, r in zip(corpora, records)]
    head = " | ".join(f"{title}: wins at / step cost" for title in titles)
    lines = [f"| toggle | {head} | verdict |", "|---|" + "---|" * len(records) + "---|"]
    for name in names:
        cells = []
        for r in records:
            won, cost = wins(r, name), r["toggles"][name]["step_cost"]
            measured = "n/a" if cost is None else f"{cost:.2f}x"
            measured += " side by side" if r["toggles"][name].get("side_by_side") else ""
            cells.append(f"{len(won)} of {len(r['horizons'])} ({', '.join(f'{h:,}' for h in won) or 'none'}) / "
                         + (f"same work ({measured})" if same_work(r["toggles"][name]["flags"]) else measured))
        lines.append(f"| {name} | {' | '.join(cells)} | {verdict(records, name)} |")
    return lines


def step_cost(text: str) -> tuple[str, float]:
    """--step-cost's NAME=RATIO."""
    name, _, ratio = text.partition("=")
    try:
        value = float(ratio)
    except ValueError:
        value = math.nan
    if not name or not value > 0:
        raise argparse.ArgumentTypeError(f"expected NAME=RATIO with a positive ratio, got {text!r}")
    return name, value


def with_step_costs(records: list[dict], costs: list[tuple[str, float]]) -> None:
    """Each (toggle, ratio) measured side by side replaces that toggle's step cost on every corpus."""
    for name, ratio in costs:
        if not any(name in r["toggles"] for r in records):
            raise ValueError(f"--step-cost {name}: no such toggle in these records")
        for r in records:
            if name in r["toggles"]:
                r["toggles"][name].update(step_cost=ratio, side_by_side=True)


def is_record(record) -> bool:
    """Whether JSON is a record bench/recipe.py wrote: its corpus, horizons, and each toggle's losses and step
    cost, which the verdict reads."""
    return (isinstance(record, dict) and {"corpus", "horizons", "toggles"} <= record.keys()
            and isinstance(record["toggles"], dict) and isinstance(record["horizons"], list)
            and all(isinstance(t, dict) and {"losses", "step_cost"} <= t.keys() for t in record["toggles"].values()))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = ScriptParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("records", nargs="+", help="bench/recipe.py's .json files (of two corpora or more to adopt)")
    p.add_argument("--out", help="also write the table to this markdown file")
    p.add_argument("--step-cost", type=step_cost, action="append", default=[], metavar="NAME=RATIO",
                   help="a toggle's time a token over the baseline's, measured side by side (repeatable)")
    a = p.parse_args(argv)
    if problem := out_problem(a.out):
        p.error(problem)
    try:
        records = []
        for path in a.records:
            with open(path) as f:
                try:
                    record = json.load(f)
                except ValueError as e:  # json's own message gives the line and column, not the file
                    raise ValueError(f"{path}: not JSON ({e})") from None
            if not is_record(record):
                raise ValueError(f"{path} is not a record bench/recipe.py wrote (its .json beside the table)")
            records.append({**record, "file": os.path.basename(path)})  # names a corpus's records apart
        with_step_costs(records, a.step_cost)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    lines = [f"Command: `{shlex.join(['python', 'bench/recipe_verdict.py', *argv])}` (rule: wins beyond both "
             f"spreads at two thirds of the horizons, at most {MAX_STEP_COST:.2f}x the step time, in every input, of "
             "two corpora or more)",
             "", *table(records)]
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        atomic_write(a.out, text.encode())
    return 0


if __name__ == "__main__":
    run_writing_results(main)
