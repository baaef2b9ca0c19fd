"""What every entry point shares: a mistake the user can fix is one `error:` line on stderr and exit code 2.

No usage dump and no traceback; a traceback means a bug in this repository.
"""

import argparse
import sys


class UsageError(Exception):
    """A mistake the user can fix from the command line."""


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(message)


def report_error(error) -> int:
    """Print the one-line error; returns the exit code for it."""
    print(f"error: {error}", file=sys.stderr)
    return 2
