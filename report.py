"""The report of a run directory: OUT/report.md, with OUT/curves.png beside it, from what the run left there.

    python report.py OUT     # write them again, from OUT alone

train.py writes both at the end of every run, finished, stopped or halted (after_run), and again at the end of
a resumed one, so that they cover every step metrics.jsonl holds. The report gathers:
- the summary rows, the machine and the software, from OUT/summary.json, which the run's last process writes
  as it ends (a run killed outright, or ended by a bug, has the summary of its earlier process, or none);
- the settings that differ from the defaults, from OUT/config.toml;
- the time split by phase, the curves, the evals and the last samples, from OUT/metrics.jsonl.
Each file is written under a temporary name and then renamed, so a report is never half written.
"""

import argparse
import json
import os
import platform
import sys
from dataclasses import fields

import torch

import config
import hardware
from atomic import atomic_write, in_the_way, replace_with
from cli import ArgumentParser, UsageError, WriteError, first_line, report_error
from option import flag_name
from progress import duration
from rundir import CONFIG_FILE, CURVES_FILE, REPORT_FILE, SUMMARY_FILE
from runlog import METRICS_FILE, MetricsError, is_count, read_metrics
from telemetry import PHASES, summary_rows

MAX_EVAL_ROWS = 40  # a longer eval table keeps evenly spaced rows and the last (thin)
LAST_SAMPLES = 3
PHASE_MEANINGS = {
    "data": "waiting for the next batch (host wall clock)",
    "forward": "forward passes and the loss, with the lm_head's and the loss's gradients, which the fused loss "
               "computes here (with --compile, the first step's includes the compilation)",
    "backward": "backward passes through the blocks and the embedding (the lm_head's ran in the forward)",
    "optimizer": "gradient clipping, the optimizer's step and zeroing the gradients",
}


# ----------------------------------------------------------------------------- what the run leaves


def machine_rows(device: torch.device, world_size: int) -> list[tuple[str, str]]:
    """The hardware and software a run ran on, as the process that ends it sees them."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        accelerator = f"{props.name}, {props.total_memory / 2**30:.0f} GiB, sm{props.major}{props.minor}"
    else:
        accelerator = "Apple MPS" if device.type == "mps" else "none: the CPU trains"
    bf16 = sorted(hardware.cpu_flags() & hardware.CPU_BF16_FLAGS)
    return [("processes", f"{world_size}" + (" (torchrun)" if world_size > 1 else "")),
            ("accelerator", accelerator),
            ("CPU", hardware.cpu_name() + (f" ({', '.join(bf16)})" if bf16 else "")),
            ("torch", torch.__version__),
            ("CUDA", torch.version.cuda or "none (a CPU build of torch)"),
            ("python", platform.python_version()),
            ("OS", platform.platform())]


def after_run(facts: dict | None, device: torch.device, world_size: int) -> None:
    """The end of a run (train.main): on rank 0, whose facts are Telemetry.summary's (None elsewhere), record
    them, the summary's rows as printed and the machine in OUT/summary.json, then write the report. A report that cannot be written costs one
    warning line, never the run's own outcome."""
    if facts is None:
        return
    out_dir = facts["out_dir"]
    try:
        summary = {"facts": facts, "rows": summary_rows(facts), "machine": machine_rows(device, world_size)}
        atomic_write(os.path.join(out_dir, SUMMARY_FILE), (json.dumps(summary, indent=1) + "\n").encode())
        written = write_report(out_dir)
    except Exception as e:  # the run's outcome, printed above, stands; so does its exit status
        print(f"warning: no report written in {out_dir} ({type(e).__name__}: {first_line(e)})", file=sys.stderr)
        return
    print(f"report: {' and '.join(written)}", flush=True)


def read_summary(out_dir: str) -> dict | None:
    """summary.json as after_run writes it, or None where there is none; UsageError for one that is not."""
    path = os.path.join(out_dir, SUMMARY_FILE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            summary = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UsageError(f"{path}: {first_line(e)}") from None
    if not (isinstance(summary, dict) and isinstance(summary.get("facts"), dict)
            and is_count(summary["facts"].get("done")) and all(is_pairs(summary.get(k)) for k in ("rows", "machine"))):
        raise UsageError(f"{path}: not the facts, rows and machine of a run's summary; move it aside to report "
                         "the run without it")
    return summary


def is_pairs(rows) -> bool:
    """Whether rows are a table's [name, value] rows, as summary.json holds the summary's and the machine's."""
    return isinstance(rows, list) and all(isinstance(row, list) and len(row) == 2 for row in rows)


def read_records(out_dir: str) -> list[dict]:
    """metrics.jsonl's records (runlog.read_metrics: a torn last line skipped, with its note on stderr), or none
    for an empty or missing file: a run that ended before its first step's record. UsageError, naming the line,
    for a damaged one."""
    try:
        records, note = read_metrics(os.path.join(out_dir, METRICS_FILE))
    except MetricsError as e:
        raise UsageError(str(e)) from None
    if note:
        print(note, file=sys.stderr)
    return records


# ----------------------------------------------------------------------------- the sections, pure


def table(header: tuple[str, ...], rows: list[tuple]) -> list[str]:
    """A Markdown table; a | inside a cell is escaped."""
    def line(cells):
        return "| " + " | ".join(str(c).replace("|", "\\|").replace("\n", " ") for c in cells) + " |"

    return [line(header), line(["---"] * len(header)), *map(line, rows)]


def config_rows(values: dict) -> list[tuple[str, str, str, str]]:
    """(setting, flag, this run's value, the default) of every setting in `values` ("section.field" -> value, as
    config.read_config_file gives OUT/config.toml) that differs from config.Config's default."""
    defaults = config.flat_values(config.Config())
    flags = {f"{section.name}.{f.name}": flag_name(f) for section in fields(config.Config)
             for f in fields(section.default_factory)}
    return [(key, f"`{flags[key]}`", shown(value), shown(defaults[key]))
            for key, value in values.items() if key in defaults and value != defaults[key]]


def shown(value) -> str:
    """A setting's value as the TOML file spells it: strings quoted, unset ones named so."""
    return "unset" if value is None else json.dumps(value) if isinstance(value, (str, bool)) else str(value)


def phase_rows(records: list[dict]) -> list[tuple[str, str, str, str]]:
    """(part, seconds, share, what it is) of the training loop's time: the records' phases summed, and what
    remains of the last record's time_s besides them (left out when the phases exceed it, as GPU-timed phases
    can). Records without phase times (written before they were logged) are left out."""
    timed = [r for r in records if all(isinstance(r.get(f"time_{p}_ms"), (int, float)) for p in PHASES)]
    total = records[-1].get("time_s") if records else None
    if not timed or not isinstance(total, (int, float)) or total <= 0:
        return []
    spent = {p: sum(r[f"time_{p}_ms"] for r in timed) / 1000 for p in PHASES}
    rows = [(p, f"{s:,.1f}", f"{100 * s / total:.1f}%", PHASE_MEANINGS[p]) for p, s in spent.items()]
    other = total - sum(spent.values())
    if other >= 0:
        rows.append(("other", f"{other:,.1f}", f"{100 * other / total:.1f}%",
                     "evals, samples, checkpoints, logging and the host's work between phases"))
    rows.append(("total", f"{total:,.1f}", "100%", f"time_s of the last step ({duration(total)}): the training "
                                                   "loop's clock, summed over resumes"))
    return rows


def thin(rows: list, limit: int) -> list:
    """At most `limit` rows (limit >= 2): evenly spaced, the first and the last kept."""
    if len(rows) <= limit:
        return rows
    return [rows[round(i * (len(rows) - 1) / (limit - 1))] for i in range(limit)]


def figure(value, missing: str = "n/a") -> str:
    """An eval's figure as the table shows it; `missing` for a value that is not a number (null, absent)."""
    return f"{value:.4f}" if isinstance(value, (int, float)) else missing


def eval_table(records: list[dict]) -> list[str]:
    """The evals' figures by step: val loss, with val bpb, HellaSwag and a mixture's per-source val loss
    (val_loss/NAME) where recorded; an eval skipped for lack of memory says so."""
    evals = [r for r in records if "val_loss" in r or "eval_skipped" in r]
    if not evals:
        return ["No eval ran (`--eval-interval` 0, or the run ended before its first)."]
    sources = sorted({k for r in evals for k in r if k.startswith("val_loss/")})
    columns = [k for k in ("val_bpb", "hellaswag_acc") if any(k in r for r in evals)] + sources
    header = ("step", "tokens", "val loss", *(c.replace("_", " ") for c in columns))
    rows = []
    for r in evals:
        if "val_loss" not in r:
            rows.append((r["step"], f"{r['tokens']:,}", f"skipped: {r['eval_skipped']}", *[""] * len(columns)))
            continue
        rows.append((r["step"], f"{r['tokens']:,}", figure(r["val_loss"]), *(figure(r.get(c), "") for c in columns)))
    kept = thin(rows, MAX_EVAL_ROWS)
    note = [] if kept is rows else ["", f"{len(kept)} of the {len(rows)} evals, evenly spaced; metrics.jsonl has "
                                        "them all."]
    return table(header, kept) + note


def fenced(text: str) -> list[str]:
    """text as a Markdown code block whose fence is longer than any run of backticks inside it."""
    longest, run = 0, 0
    for ch in text:
        run = run + 1 if ch == "`" else 0
        longest = max(longest, run)
    fence = "`" * max(3, longest + 1)
    return [fence + "text", text, fence]


def sample_lines(records: list[dict]) -> list[str]:
    samples = [r for r in records if isinstance(r.get("sample"), str)]
    if not samples:
        return ["None recorded: `--sample-tokens` is 0 (off, the default), or no eval ran."]
    lines = []
    for r in samples[-LAST_SAMPLES:]:
        lines += [f"Step {r['step']:,}:", "", *fenced(r["sample"]), ""]
    return lines[:-1]


def render(out_dir: str, records: list[dict], summary: dict | None, settings: dict | str | None,
           curves: bool) -> str:
    """The report's text. settings: config.toml's values, or why they could not be read (None: no file);
    curves: whether curves.png was drawn. Pure."""
    steps = f"steps {records[0]['step']:,} to {records[-1]['step']:,}" if records else "no step recorded"
    lines = [f"# Run report: {out_dir}", "",
             f"From `{METRICS_FILE}` ({len(records):,} records, {steps}), `{CONFIG_FILE}` and `{SUMMARY_FILE}`; "
             f"`python report.py {out_dir}` writes it again.", ""]
    lines += ["## Summary", ""]
    if summary is None:
        lines += [f"No `{SUMMARY_FILE}`: no process of this run reached its end-of-run summary (killed outright, or "
                  "ended by a bug)."]
    else:
        lines += table(("", ""), summary["rows"])
        if records and (done := summary["facts"]["done"]) != records[-1]["step"]:
            lines += ["", f"This is the summary of a process that ended at step {done:,}; the steps go on to "
                          f"{records[-1]['step']:,}, and their process did not reach its summary."]
    lines += ["", "## Settings that differ from the defaults", ""]
    if settings is None:
        lines += [f"No `{CONFIG_FILE}` in the run directory."]
    elif isinstance(settings, str):
        lines += [f"`{CONFIG_FILE}` cannot be read: {settings}"]
    else:
        rows = config_rows(settings)
        lines += table(("setting", "flag", "this run", "default"), rows) if rows else ["None: every setting is "
                                                                                       "its default."]
    lines += ["", "## Hardware and software", ""]
    lines += table(("", ""), summary["machine"]) if summary else ["Not recorded (no summary)."]
    lines += ["", "## Time by phase", ""]
    if rows := phase_rows(records):
        lines += ["Seconds of the training loop, from `metrics.jsonl`: the phases of every step (CUDA events on a "
                  "GPU, wall clock elsewhere), and the rest of the loop's clock. Start-up, and what ran after "
                  "the last step (its eval and checkpoint), are not in it.", "",
                  *table(("part", "seconds", "share", "what it is"), rows)]
    else:
        lines += ["No phase times recorded."]
    lines += ["", "## Curves", ""]
    lines += ["Train loss and val loss (markers), tokens/s and the learning rate, against tokens trained. Past 100 "
              "steps the train loss and tokens/s are smoothed over about 1% of the steps, the raw steps faint "
              "behind them; the loss axis leaves out the first steps' far higher losses (`bench/plot.py` draws "
              "them with other choices).", "", f"![curves]({CURVES_FILE})"] if curves else ["No steps to draw."]
    plan = summary and summary["facts"].get("eval_plan")
    lines += ["", "## Evals", "", f"Evals ran {plan}." if plan else "Val loss and bpb are taken on `--eval-tokens` "
              "of the val split, in windows at places a fixed seed draws across the split: the same tokens every "
              "eval and every run on the same shards (the start-up table's eval row says which split and how "
              "prepare.py chose its documents).", "", *eval_table(records)]
    lines += ["", "## Last samples", "", *sample_lines(records)]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- writing it


def read_settings(out_dir: str) -> dict | str | None:
    """config.toml's values, or why they cannot be read, or None where there is no such file."""
    path = os.path.join(out_dir, CONFIG_FILE)
    if not os.path.isfile(path):
        return None
    try:
        return config.read_config_file(path)
    except UsageError as e:
        return str(e).removeprefix(f"--config {path}: ")


def draw_curves(out_dir: str, records: list[dict]) -> str:
    """curves.png of the run (curves.py's panels, with its defaults) -> its path."""
    import curves  # matplotlib is only needed once a run ends

    path = os.path.join(out_dir, CURVES_FILE)
    fig = curves.draw_runs({os.path.basename(os.path.normpath(out_dir)): records})
    try:
        replace_with(path, lambda f: fig.savefig(f, dpi=120, format="png"))
    finally:
        curves.plt.close(fig)
    return path


def check_targets(out_dir: str, names: list[str]) -> None:
    """UsageError, before anything is written, where one of the files the report replaces is a directory or
    another thing that is not a file: the report would stop half written (curves.png new, report.md old)."""
    for name in names:
        path = os.path.join(out_dir, name)
        if kind := in_the_way(path):
            raise UsageError(f"{path} is {kind}, which the report would replace; move it aside to write the "
                             "report (nothing was written)")


def write_report(out_dir: str) -> list[str]:
    """Write OUT/report.md and, when there are steps to draw, OUT/curves.png -> their paths. UsageError for a
    directory that holds no run (neither metrics.jsonl nor summary.json) or one whose files cannot be read."""
    if not os.path.isdir(out_dir):
        raise UsageError(f"{out_dir}: no such directory")
    summary, records = read_summary(out_dir), read_records(out_dir)
    if summary is None and not records:
        raise UsageError(f"{out_dir} holds no run: no {METRICS_FILE} with records, no {SUMMARY_FILE} (is it a "
                         "train.py --out-dir?)")
    check_targets(out_dir, [REPORT_FILE, *([CURVES_FILE] if records else [])])
    curves = [draw_curves(out_dir, records)] if records else []
    path = os.path.join(out_dir, REPORT_FILE)
    atomic_write(path, render(out_dir, records, summary, read_settings(out_dir), bool(curves)).encode())
    return [path, *curves]


def main(argv=None) -> int:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", metavar="OUT", help="a train.py --out-dir")
    try:
        written = write_report(parser.parse_args(argv).out_dir)
    except (UsageError, WriteError) as e:  # WriteError: one line naming the file and the space left
        sys.exit(report_error(e))
    except OSError as e:
        sys.exit(report_error(f"{e.filename}: {e.strerror or e}"))
    print(f"wrote {' and '.join(written)}")
    return 0


if __name__ == "__main__":
    main()
