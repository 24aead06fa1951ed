"""`hybridrl.env`: the name notebooks and setup scripts used before the package was grouped into
role folders (`import hybridrl.env; hybridrl.env.setup()`, `python -m hybridrl.env` to build
DeepSpeed's ops); it is `hybridrl.run.environ` itself. New code: `hybridrl.run.environ`."""

import runpy
import sys

if __name__ == "__main__":  # python -m hybridrl.env: environ's own entry point
    runpy.run_module("hybridrl.run.environ", run_name="__main__", alter_sys=True)
else:
    from hybridrl.run import environ as _module

    sys.modules[__name__] = _module
