"""`hybridrl.env`: the name notebooks and setup scripts used before the package was grouped into
role folders (`import hybridrl.env; hybridrl.env.setup()`); it is `hybridrl.core.environ` itself.

`python -m hybridrl.env` builds DeepSpeed's JIT ops into the cache once (the setup runs it), so the
first run does not spend minutes compiling. It lives here, at the top of the package, because
building needs the DeepSpeed boundary (engines/deepspeed_compat.py), which the ground floor's
environ must not import (docs/design.md, "The floors")."""

import sys

if __name__ == "__main__":  # python -m hybridrl.env
    from hybridrl.core import environ
    from hybridrl.core.config import UserError

    try:
        environ.setup()
    except UserError as e:
        raise SystemExit(f"error: {e}") from None
    from hybridrl.engines import deepspeed_compat  # imports torch: after setup()

    deepspeed_compat.build_ops(environ.deepspeed_ops())
else:
    from hybridrl.core import environ as _module

    sys.modules[__name__] = _module
