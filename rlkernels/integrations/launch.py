"""Run a trainer's worker module with rlkernels' adapters installed first (activation.py):

    python -m rlkernels.integrations.launch areal areal.infra.rpc.rpc_server [the worker's own arguments]

is `python -m areal.infra.rpc.rpc_server [...]` after `rlkernels.integrations.areal.install()`. The first argument
names the adapters (comma-separated); every argument after the module is the module's, untouched, so a scheduler
that appends its own (AReaL's `--experiment-name ... --worker-index ...`) reaches the worker as before.
"""

import importlib
import runpy
import sys
from typing import List, Sequence

USAGE = "usage: python -m rlkernels.integrations.launch ADAPTER[,ADAPTER...] MODULE [ARGS...]"


def install_adapters(names: str) -> List[str]:
    """Call `install()` of each adapter named in the comma-separated `names`; returns the names."""
    adapters = [name.strip() for name in names.split(",") if name.strip()]
    for name in adapters:
        try:
            adapter = importlib.import_module(f"rlkernels.integrations.{name}")
        except ModuleNotFoundError:
            raise SystemExit(f"rlkernels.integrations.launch: no adapter named {name!r}\n{USAGE}") from None
        if not callable(getattr(adapter, "install", None)):
            raise SystemExit(f"rlkernels.integrations.launch: rlkernels.integrations.{name} has no install(); "
                             f"its docstring says how it is selected\n{USAGE}")
        adapter.install()
    return adapters


def main(argv: Sequence[str]) -> None:
    if len(argv) < 2:
        raise SystemExit(USAGE)
    install_adapters(argv[0])
    module = argv[1]
    sys.argv = [module, *argv[2:]]  # what `python -m module args...` would have given it
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
