import os
import tempfile

# Caches go where the setup built them (the Makefile sets this), never ~/.cache.
os.environ.setdefault("HYBRIDRL_CACHE_DIR", os.path.join(tempfile.gettempdir(), "hybridrl-cache"))

from hybridrl import env  # noqa: E402

env.setup()
