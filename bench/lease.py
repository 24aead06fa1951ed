"""Moved to scripts/lease.py (it runs a GPU lease; it is no benchmark). `python -m bench.lease ...`,
the command issue 51 and older notes name, still runs it, and `bench.lease` is that module."""

import runpy
import sys

if __name__ == "__main__":
    runpy.run_module("scripts.lease", run_name="__main__", alter_sys=True)
else:
    from scripts import lease as _lease

    sys.modules[__name__] = _lease
