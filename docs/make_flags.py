"""Write docs/flags.md, the flag reference, from the command-line parsers themselves.

    python docs/make_flags.py           # (re)write docs/flags.md
    python docs/make_flags.py --check   # exit 1 when docs/flags.md differs from what the parsers give

train.py's parser is generated from the configuration dataclasses (config.build_parser), so a new field is a
new row here after one run of this script; tests/test_docs.py fails while docs/flags.md is stale.
"""

import argparse
import os
import re
import sys

DOCS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(DOCS))
import config  # noqa: E402
import prepare  # noqa: E402
import sample  # noqa: E402
import score  # noqa: E402

FLAGS_MD = os.path.join(DOCS, "flags.md")
# The command lines with a parser builder, in the order a run meets them.
CLIS = (("train.py", config.build_parser), ("prepare.py", prepare.build_parser), ("sample.py", sample.build_parser),
        ("score.py", score.build_parser))
# Command lines whose parser is built inside main(): --help is their reference.
OTHER_CLIS = ("hf.py", "checkpoint.py")
DEFAULT_SUFFIX = re.compile(r"\s*\(default: (.*)\)$")


def split_default(help_text: str) -> tuple[str, str]:
    """A help text ending in its only "(default: X)" -> (the text before it, X); otherwise (the text, "").
    A text with several defaults (one per case) stays whole."""
    match = DEFAULT_SUFFIX.search(help_text)
    if not match or help_text.count("(default:") > 1:
        return help_text, ""
    return help_text[:match.start()], match.group(1)


def default_text(action: argparse.Action, stated: str) -> str:
    """The default column: what the help states, else the parser's default; an on/off flag is on or off."""
    if action.nargs == 0:
        return "on" if stated == "True" else "off"
    if stated:
        return stated
    return "" if action.default in (None, argparse.SUPPRESS) else str(action.default)


def invocation(action: argparse.Action) -> str:
    """How a flag is written: its option strings, then its value (choices, or the metavar) unless it takes none."""
    flags = " / ".join(action.option_strings)
    if action.nargs == 0:
        return flags
    value = "{" + ",".join(map(str, action.choices)) + "}" if action.choices else action.metavar or action.dest.upper()
    return f"{flags} [{value}]" if action.nargs == "?" else f"{flags} {value}"


def cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def row(action: argparse.Action) -> str:
    help_text = (action.help or "") % {**vars(action), "prog": ""}  # argparse's own %(default)s expansion
    help_text, stated = split_default(help_text)
    default = default_text(action, stated)
    required = " (required)" if action.required else ""
    return f"| `{cell(invocation(action))}`{required} | {cell(default) or '–'} | {cell(help_text)} |"


def cli_section(name: str, parser: argparse.ArgumentParser) -> list[str]:
    lines = [f"## {name}", ""]
    for group in parser._action_groups:  # argparse keeps its groups here; it has no public accessor
        actions = [a for a in group._group_actions if a.option_strings and not isinstance(a, argparse._HelpAction)]
        if actions:
            lines += [f"### {group.title}", "", "| flag | default | meaning |", "|---|---|---|",
                      *map(row, actions), ""]
    return lines


def render() -> str:
    lines = ["# Flag reference", "",
             "Written by `python docs/make_flags.py` from the parsers; do not edit by hand. The same text, with "
             "the defaults, is each program's `--help`.", ""]
    for name, build in CLIS:
        lines += cli_section(name, build())
    lines += ["## Other programs", "", *(f"- `python {name} --help`" for name in OTHER_CLIS), ""]
    return "\n".join(lines)


def write_or_check(path: str, text: str, check: bool, command: str) -> int:
    """Write a generated page (or, with check, exit 1 when the page there differs from text); docs/make_map.py
    shares it."""
    if check:
        current = open(path, encoding="utf-8").read() if os.path.exists(path) else ""
        if current != text:
            print(f"{path} is stale: run {command}", file=sys.stderr)
            return 1
        return 0
    temporary = path + ".tmp"
    with open(temporary, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(temporary, path)
    print(f"wrote {path}")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/flags.md is stale; write nothing")
    return write_or_check(FLAGS_MD, render(), parser.parse_args(argv).check, "python docs/make_flags.py")


if __name__ == "__main__":
    sys.exit(main())
