"""Reading a run's metrics.jsonl, the one reader that train.py's resume, report.py and curves.py share.

A record is one JSON line, written whole and flushed as each step is counted. A process killed mid-write can
leave its last line torn: no newline, and not JSON. Such a line holds no record anyone could use, so every
reader skips it with one note, and a resume drops it when it rewrites the log. Any other line that is not a
record is damage a person should look at: it is refused, naming the file and line, never dropped.
"""

import json
import os

from records import row_problem

METRICS_FILE = "metrics.jsonl"


class MetricsError(Exception):
    """A metrics file that cannot be read as records; its message names the file and line."""


def read_metrics(path: str, required: tuple[str, ...] = ("step", "tokens")) -> tuple[list[dict], str | None]:
    """-> (the records of the metrics.jsonl at path, in file order; a note when a torn last line was
    skipped). No file: no records. MetricsError for a line, other than a torn last one, that is not a JSON
    object with an integer under each key of `required` (blank lines hold nothing and are passed over)."""
    if not os.path.isfile(path):
        return [], None
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = f.readlines()
    records = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if lineno == len(lines) and not line.endswith("\n"):
                return records, f"note: {path}:{lineno}: the last line was torn (a process stopped mid-write), skipped"
            raise MetricsError(f"{path}:{lineno}: not a JSON line") from None
        if not isinstance(record, dict):
            raise MetricsError(f"{path}:{lineno}: not a JSON object")
        if missing := [key for key in required if not is_count(record.get(key))]:
            raise MetricsError(f"{path}:{lineno}: a record without an integer '{missing[0]}'")
        if problem := row_problem(record, required):
            raise MetricsError(f"{path}:{lineno}: {problem}")
        records.append(record)
    return records, None


def is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
