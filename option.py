"""How every config section declares a field: its default, help text, flag name and choices.

How every config section declares a field: option(default, help, flag=..., choices=...). The sections'
dataclasses live with the code they configure (model.ModelConfig, optim.OptimConfig, ...); config.py turns
their fields into flags, --help and docs/flags.md, so a field's default and help are written here once.
A leaf: it imports nothing of the project, so that model.py stays readable on its own.
"""

from dataclasses import Field, field


def option(default, help, **flag):
    """A config field: its default, its help text and, where the flag needs them, its flag name, choices or
    type (flag="--optimizer", choices=(...), type=...)."""
    return field(default=default, metadata={"help": help, **flag})


def flag_name(f: Field) -> str:
    """A field's flag: its metadata's "flag", else --the-field-name."""
    return f.metadata.get("flag", "--" + f.name.replace("_", "-"))
