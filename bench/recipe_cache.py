"""bench/recipe.py's runs as its cache keeps them: what a finished run left (run_result), the key a run's
configuration is kept under (cache_key), and the cache file (Cache). A key is the configuration a run's flags
resolve to, so that a changed default is a new run; what the first runs lacked is read as they ran."""
import fcntl
import json
import os
import statistics
import sys
import threading

import config
from atomic import atomic_write
from curves import read_metrics
from hardware import CPU_BF16_FLAGS, cpu_flags
from model import QWEN3_VALUES
from optimizers import cpu_model

# Fields added after the cache's first runs, other than model toggles, at the value those runs had: left out of
# a key at that value (cache_key), so that adding one does not make every cached run a miss.
SINCE_THE_FIRST_RUNS = {"fp8.head": False, "fp8.fused_wgrad": False, "speed.activation_dtype": "fp32"}
STEP_TIME_SKIP = 3  # first steps left out of the median step time: allocation and warm caches


class BenchError(Exception):
    """A bad flag or a failed run; reported in one line, exit code 2."""


def timing_machine(threads: int) -> str:
    """What a step time was measured on, as the cache files it: the CPU's model name alone is not enough (one
    "AMD EPYC" has native bf16 and another has not), nor is the machine without its threads per run."""
    bf16 = "native bf16" if cpu_flags() & CPU_BF16_FLAGS else "no native bf16"
    return f"{cpu_model()}, {bf16}, {threads} thread{'s' if threads > 1 else ''} a run"


def run_result(out_dir: str, params: int | None, machine: str) -> dict:
    """A finished run's entry: its final val loss, tokens, median step time (after the first STEP_TIME_SKIP
    steps, from each step's own tokens/s, which leaves out evals and start-up) on machine (timing_machine) and
    parameter count (None: the run's summary.json has it, as bench/anchor.py writes it)."""
    records = read_metrics(out_dir)
    last = records[-1]
    if "val_loss" not in last:
        raise BenchError(f"{out_dir}/metrics.jsonl: the last step has no val_loss (was evaluation turned off?)")
    skip = min(STEP_TIME_SKIP, last["step"] - 1)  # a run shorter than that still has its last step
    step_s = [(r["tokens"] - before["tokens"]) / r["tokens_per_sec"]
              for before, r in zip([{"tokens": 0}, *records], records) if r["step"] > skip and r.get("tokens_per_sec")]
    curve = [[r["tokens"], r["val_loss"]] for r in records if r.get("val_loss") is not None]
    try:
        with open(os.path.join(out_dir, "summary.json")) as f:
            summary = json.load(f)
    except FileNotFoundError:  # a train.py run whose report could not be written: its params are known
        summary = {}
    params = summary["params"] if params is None else params
    precision = summary.get("facts", {}).get("precision")  # what --dtype chose, which the key's auto cannot say
    step = statistics.median(step_s) if step_s else None
    return {"val_loss": float("nan") if last["val_loss"] is None else float(last["val_loss"]),
            "tokens": last["tokens"], "step_s": step, "step_s_on": {machine: step} if step else {},
            "params": params, "curve": curve, **({"precision": precision} if precision else {})}


# Where a run reads and writes, not what it computes: the corpus id stands for the data's path.
LOCATION_FIELDS = ("data.data", "ckpt.out_dir", "ckpt.resume", "ckpt.overwrite")


def cache_key(corpus: str, flags: list[str]) -> str:
    """flags: the run's whole train.py command line but its --out-dir (toggle, horizon and seed among them). The
    key is the configuration they resolve to, every field's value, so that a changed default (a toggle adopted)
    is a different run, never a cached one. A model toggle at Qwen3's value, and each field of
    SINCE_THE_FIRST_RUNS at its value there, is left out: that is how every run trained before the field existed
    (model.with_qwen3_toggles), so a new field keeps the entries reachable; any other new field makes every
    entry a miss, which errs towards running."""
    values = config.flat_values(config.parse_args(flags))
    return settings_key(corpus, {k: v for k, v in values.items() if k not in LOCATION_FIELDS})


def settings_key(corpus: str, values: dict) -> str:
    """The key of a run of these flat config values, leaving out each field at the value every run had before
    the field existed (the model toggles at Qwen3's values, SINCE_THE_FIRST_RUNS)."""
    before = {**{f"model.{name}": value for name, value in QWEN3_VALUES.items()}, **SINCE_THE_FIRST_RUNS}
    kept = {k: v for k, v in values.items() if k not in before or before[k] != v}
    return json.dumps([corpus, kept], sort_keys=True)


def current_key(key: str) -> str:
    """A stored key as cache_key writes it now (entries written before it left out the toggles at Qwen3's values
    hold them; those written before the bench pinned --device cpu hold auto, which chose the CPU: no GPU made a
    cached run); an anchor's key, or any other, as it is."""
    try:
        parts = json.loads(key)
    except ValueError:
        return key
    if not (isinstance(parts, list) and len(parts) == 2 and isinstance(parts[1], dict)):
        return key
    corpus, values = parts
    return settings_key(corpus, {**values, "speed.device": "cpu"} if values.get("speed.device") == "auto" else values)


def anchor_key(corpus: str, flags: list[str]) -> str:
    """bench/anchor.py's flags, which are its own, not train.py's."""
    return json.dumps([corpus, "anchor", *flags])


class Cache:
    """key -> run_result, in a JSON file rewritten (atomically) after every run, so that a sweep stopped midway
    keeps what it finished. Each write adds its one entry to the file as it is on disk then, under a lock, so
    that two sweeps at once keep each other's runs."""

    def __init__(self, path: str):
        self.path, self.lock = path, threading.Lock()
        self.entries = self._read(say_merged=True)

    def _read(self, say_merged: bool = False) -> dict:
        try:
            with open(self.path) as f:
                stored = json.load(f)
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as e:
            raise BenchError(f"{self.path}: not a readable cache ({e}); move it away or give another --cache") from None
        entries = {current_key(key): entry for key, entry in stored.items()}
        if say_merged and len(entries) < len(stored):
            print(f"note: {self.path}: {len(stored) - len(entries)} stored run(s) read as another's configuration "
                  "(they differ only in a field left out of keys); the one later in the file is kept", file=sys.stderr)
        return entries

    def put(self, key: str, result: dict) -> None:
        """A rerun (--fresh) replaces the entry but keeps its step times on other CPUs: losses pool across
        machines at one precision, step times only within one."""
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        with self.lock, open(f"{self.path}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            self.entries = {**self.entries, **self._read()}
            earlier = self.entries.get(key, {}).get("step_s_on", {})
            self.entries[key] = {**result, "step_s_on": {**earlier, **result.get("step_s_on", {})}}
            atomic_write(self.path, json.dumps(self.entries, indent=1, sort_keys=True).encode())
