"""Run a benchmark with torch's opaque-type API also under the names torch 2.14 gives it.

    python bench/te_opaque_names.py bench/profile_step.py [its flags]

Transformer Engine 2.20 registers the custom ops of its torch.compile path through
`torch._library.opaque_object.register_custom_class` and `is_opaque_constant_type`. torch 2.13 has the same
functions as `register_opaque_type` (a type "value" where 2.14 says "constant") and `is_opaque_value_type`; where
the new names are missing TE switches its compiled path off, and each TE module is a graph break that runs
eagerly (on an H200 with torch 2.11 the GPU then waited 14 to 33 ms a step at about 1B:
bench/results/gpu_check_20261130). This script adds the new names, then runs the given script as `python SCRIPT`
would, so that a GPU lease can measure whether TE's compiled path works and pays with them. It is a
measurement: train.py does not alias them.
"""

import os
import runpy
import sys

import torch
from torch._library import opaque_object


def add_new_names(module=opaque_object) -> str:
    """Give `module` torch 2.14's names for its opaque-type functions where it has only the earlier ones;
    -> "added", "present" (the new names are there) or "absent" (neither: no opaque-type API to alias)."""
    if hasattr(module, "is_opaque_constant_type"):
        return "present"
    if not hasattr(module, "is_opaque_value_type"):
        return "absent"

    def register_custom_class(cls, *, typ: str, **kwargs) -> None:
        module.register_opaque_type(cls, typ="value" if typ == "constant" else typ, **kwargs)

    module.register_custom_class = register_custom_class
    module.is_opaque_constant_type = module.is_opaque_value_type
    return "added"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    if not argv or not os.path.isfile(argv[0]):
        print(f"error: {'no script given' if not argv else f'{argv[0]}: no such file'}: "
              "python bench/te_opaque_names.py SCRIPT [its flags]", file=sys.stderr)
        return 2
    state = add_new_names()
    if state == "absent":  # the run would only repeat the one without this script
        print(f"error: torch {torch.__version__} has no opaque-type API (neither is_opaque_value_type nor "
              "is_opaque_constant_type): nothing to alias", file=sys.stderr)
        return 1
    print(f"te_opaque_names: torch {torch.__version__}'s opaque-type API "
          f"{'aliased to' if state == 'added' else 'already has'} torch 2.14's names", file=sys.stderr)
    sys.argv = argv
    runpy.run_path(argv[0], run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
