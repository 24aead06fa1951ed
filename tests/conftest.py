import os
import tempfile

# Caches go where the setup built them (the Makefile sets this), never ~/.cache.
os.environ.setdefault("HYBRIDRL_CACHE_DIR", os.path.join(tempfile.gettempdir(), "hybridrl-cache"))
# The suite needs no hub: an empty Hugging Face home, offline (hybridrl itself never moves HF_HOME,
# so a user's token and model cache stay where they are), and no test can reach the network.
os.environ["HF_HOME"] = tempfile.mkdtemp(prefix="hybridrl-test-hf-")
os.environ["HF_HUB_OFFLINE"] = "1"

from hybridrl import env  # noqa: E402

env.setup()
