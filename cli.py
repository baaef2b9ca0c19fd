"""What every entry point shares: one-line errors with exit code 2, --help's defaults, the cache directory.

A mistake the user can fix is one `error:` line on stderr: no usage dump and no traceback; a traceback
means a bug in this repository. Also shared: --help that states each option's default (HelpFormatter),
counts written out with their nouns (plural), and the project's cache (cache_root).
"""

import argparse
import difflib
import os
import shutil
import signal
import sys
import time

# How long a rank other than 0 waits before exiting on a start-up error (report_startup_error).
STARTUP_ERROR_GRACE_S = 1.0


class UsageError(Exception):
    """A mistake the user can fix from the command line."""


class DataError(Exception):
    """A problem with the user's data or environment. The message is one line and names the file at fault."""


CACHE_ENV = "PRETRAIN_CACHE_DIR"


def cache_root() -> str:
    """The project's cache (tokenizer file, default corpus): $PRETRAIN_CACHE_DIR, else ~/.cache/pretrain."""
    if os.environ.get(CACHE_ENV):
        return os.environ[CACHE_ENV]
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(xdg, "pretrain")


class WriteError(Exception):
    """A file that could not be written (a full disk, a failing device), its partial file removed; the message
    (write_error's) is one line naming the file and the space left."""


def write_error(what: str, path: str, error: BaseException, after: str = "") -> WriteError:
    """WriteError 'cannot write WHAT PATH: WHY (N MiB free on its filesystem)' and `after`; called once the
    partial file is gone, so that the space it says is what a retry would find."""
    why = error.strerror if isinstance(error, OSError) and error.strerror else first_line(error)
    return WriteError(f"cannot write {what} {path}: {why} ({free_space(path)}){after}")


def free_bytes(path: str) -> int | None:
    """Free bytes on the filesystem a write to path goes to (its directory's), or None when unknown."""
    try:
        return shutil.disk_usage(os.path.dirname(os.path.abspath(path))).free
    except OSError:
        return None


def free_space(path: str) -> str:
    """'12.0 MiB free on its filesystem', for a message about a write to path that failed."""
    free = free_bytes(path)
    return "free space unknown" if free is None else f"{free / 2**20:,.1f} MiB free on its filesystem"


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser with one-line errors (UsageError) that suggest the flag a mistyped one meant. A prefix of
    a flag is not taken for it (allow_abbrev): `--ckpt X` would set --ckpt-interval, and a prefix that is a whole
    flag in a sibling script (sample.py's --ckpt) would be read silently as this one's."""

    def __init__(self, *args, elsewhere: dict[str, str] | None = None, **kwargs):
        """elsewhere: flags of a sibling script that users give this one -> where they belong, said instead of
        the nearest of this parser's flags (train.py's --ckpt is not --act-ckpt)."""
        super().__init__(*args, allow_abbrev=False, **kwargs)
        self.elsewhere = elsewhere or {}

    def parse_known_args(self, args=None, namespace=None):
        """A mistyped flag is named before the required one it left missing (`--ot DIR` for --out): argparse
        checks the required flags first, which would leave the typo unmentioned."""
        args = sys.argv[1:] if args is None else list(args)
        try:
            return super().parse_known_args(args, namespace)
        except UsageError as e:
            options = args[:args.index("--")] if "--" in args else args  # after "--", positionals only
            known = self._option_string_actions
            unknown = [word for word in options if word.startswith("--") and word.split("=")[0] not in known]
            if not unknown or not str(e).startswith(("the following arguments are required", "one of the arguments")):
                raise
            self.error(f"unrecognized arguments: {' '.join(unknown)}")

    def error(self, message):
        raise UsageError(message + self.suggestion(message))

    def suggestion(self, message: str) -> str:
        """"; did you mean --lr?" for an unrecognized option close to one of this parser's, else ""."""
        if not message.startswith("unrecognized arguments: "):
            return ""
        known = [option for option in self._option_string_actions if option.startswith("--")]
        # A flag of this parser's among them came after "--", which makes it a positional: nothing to suggest.
        given = [word.split("=")[0] for word in message.split(": ", 1)[1].split()
                 if word.startswith("--") and word.split("=")[0] not in known]
        close = [(word, difflib.get_close_matches(word, known, n=1, cutoff=0.75)) for word in given]
        return "".join(f"; {self.elsewhere[word]}" if word in self.elsewhere else
                       f"; did you mean {match[0]}{'' if len(given) == 1 else f' for {word}'}?"
                       for word, match in close if match or word in self.elsewhere)


class ScriptParser(ArgumentParser):
    """ArgumentParser for a script that leaves its flags' mistakes to its parser (the benchmarks): argparse's, or
    one its main finds (parser.error), is the same one line, "error: ...", and exit status 2, without argparse's
    usage lines. While parsing, errors still raise, so that ArgumentParser can name a mistyped flag before the
    required one it left missing."""

    parsing = False

    def parse_known_args(self, args=None, namespace=None):
        self.parsing = True
        try:
            return super().parse_known_args(args, namespace)
        except UsageError as e:
            sys.exit(report_error(e))
        finally:
            self.parsing = False

    def error(self, message):
        if self.parsing:
            super().error(message)  # raises UsageError, for parse_known_args
        else:
            sys.exit(report_error(message + self.suggestion(message)))


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """--help with the description as written and every option's default: "(default: X)" after its help,
    unless the help states it already or there is none to state (None, empty, an on/off flag's off)."""

    def _get_help_string(self, action):  # the hook argparse.ArgumentDefaultsHelpFormatter overrides too
        text = action.help or ""
        none = action.default in (None, argparse.SUPPRESS, "", []) or action.nargs == 0 or not action.option_strings
        return text if "(default:" in text or none else f"{text} (default: %(default)s)".lstrip()


def plural(n: int, noun: str, plural_noun: str | None = None) -> str:
    """A count and its noun: "1 shard", "2 shards", "1,024 tokens", plural(3, "batch", "batches")."""
    return f"{n:,} {noun if n == 1 else plural_noun or noun + 's'}"


def int_or_auto(text: str) -> int | str:
    """A flag's value that is a whole number or the word auto (--batch-size, prepare.py's --val-tokens)."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer or auto, got {text!r}") from None


def count(text: str) -> int:
    """A flag's value that counts something there must be at least one of (a benchmark's windows, its steps)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def out_problem(path: str | None, makes_folder: bool = False) -> str | None:
    """Why a benchmark's --out could not be written once it has measured, or None: asked before the measurement,
    which a late failure would throw away. A directory is in its place (or the path names one, ending in a
    slash); its folder is missing where the benchmark does not make it, or a file stands where it would."""
    if not path:
        return None
    if path.endswith(("/", os.sep)) or os.path.isdir(path):
        return f"--out {path}: a directory, where a file is to be written"
    folder = os.path.dirname(os.path.abspath(path))
    if not makes_folder:
        return None if os.path.isdir(folder) else f"--out {path}: no directory {folder}"
    existing = folder
    while not os.path.exists(existing):  # the nearest ancestor there is: the folders below it can be made
        existing = os.path.dirname(existing)
    return None if os.path.isdir(existing) else f"--out {path}: {existing} is a file, where a directory is to be made"


def first_line(error: BaseException) -> str:
    """The first line of an error from another library, for a one-line message; its type when it says nothing."""
    return str(error).splitlines()[0] if str(error) else type(error).__name__


def report_error(error) -> int:
    """Print the one-line error; returns the exit code for it."""
    print(f"error: {error}", file=sys.stderr)
    return 2


def run_writing_results(main) -> None:
    """Run a bench entry point whose measurements end in files: a file it cannot write (a full disk) ends it
    with that file's one-line error and exit 2, after what it printed, rather than a traceback. main's return
    value, if any, is the exit status."""
    try:
        status = main()
    except WriteError as e:
        status = report_error(e)
    sys.exit(status)


def closed_stdout() -> int:
    """For an entry point whose stdout reader stopped early (`| head`): no traceback, and the exit status of
    a program SIGPIPE stopped, 128 + 13, which the shell reports for `yes` in `yes | head` (0 would claim that
    all of the output was read; `set -o pipefail` scripts tell the two apart)."""
    _stdout_to_devnull()
    return 128 + signal.SIGPIPE


def unwritable_stdout(error: OSError) -> int:
    """For an entry point whose stdout could not be written (a redirect to a full disk): its one-line error,
    exit 2, rather than a traceback."""
    _stdout_to_devnull()
    return report_error(f"cannot write to standard output: {error.strerror or error}")


def _stdout_to_devnull() -> None:
    """The interpreter flushes stdout once more at exit, which would fail again, with a message of its own."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


# What torchrun sets for every rank, and distributed.py reads: a process that lacks any of them was not started
# by a launcher, so no rank 0 runs beside it to say what went wrong.
LAUNCH_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def speaks_for_the_run() -> bool:
    """Whether this process tells the user what happened to the run: rank 0, or a process without the whole
    LAUNCH_ENV (one process, or RANK=1 set by hand: no rank 0 runs beside it)."""
    return os.environ.get("RANK", "0") == "0" or not all(os.environ.get(name) for name in LAUNCH_ENV)


def report_startup_error(error) -> int:
    """report_error for a program torchrun may start as several ranks that all fail alike: the one that
    speaks_for_the_run prints. The other ranks wait a moment before their exit, because torchrun stops every
    rank as soon as one exits, which could cut rank 0 off before it has said why."""
    if speaks_for_the_run():
        return report_error(error)
    time.sleep(STARTUP_ERROR_GRACE_S)
    return 2
