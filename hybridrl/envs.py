"""`hybridrl.envs`: the name reward and environment files imported before the package was grouped
into role folders; it is `hybridrl.data.envs` itself (the same module object), kept so those files run
unchanged. New code imports the public names from `hybridrl` (docs/api.md)."""

import sys

from hybridrl.data import envs as _module

sys.modules[__name__] = _module
