"""Loads a script of examples/ as a module, for the tests that run it at its reduced size.

The tests call the example's `main(argv)` in their own process: its results come back as
Python objects, and it runs on the 8 host devices and with the compiler settings of
conftest.py, as the other tests do.
"""

import importlib.util
import pathlib
import sys
import types

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"


def load_example(name: str) -> types.ModuleType:
    """Imports examples/<name>.py afresh, as the module `example_<name>`.

    Call it inside the test, not at collection: an example imports its plotting and data
    libraries, which the quick loop should not pay for. The module is registered in
    `sys.modules`, as an import would do: Flax modules are dataclasses, which look their
    module up there.
    """
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
