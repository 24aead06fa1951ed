"""`hybridrl.tasks`: the name scripts imported before the package was grouped into role folders
(`from hybridrl.tasks import arithmetic`); it is `hybridrl.data.tasks` itself, and
`hybridrl.tasks.arithmetic` is `hybridrl.data.tasks.arithmetic` (registered here, so the import
system finds it instead of loading the file a second time under the old name)."""

import sys

from hybridrl.data import tasks as _module
from hybridrl.data.tasks import arithmetic as _arithmetic

sys.modules[__name__ + ".arithmetic"] = _arithmetic
sys.modules[__name__] = _module
