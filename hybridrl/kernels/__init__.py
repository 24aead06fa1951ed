"""`hybridrl.kernels`: the repository's top-level `kernels/` folder, imported under the package.

In a checkout (run from the repository, or installed with `pip install -e .`) this package's path
is that folder, so `hybridrl.kernels.logprob` is `kernels/logprob.py`. A built wheel never holds this
file: pyproject.toml maps `hybridrl.kernels` to `kernels/`, so the wheel's `hybridrl/kernels/` holds
the kernels themselves. `kernels/` has no `__init__.py` on purpose (a top-level `kernels` package
would shadow Hugging Face's `kernels`: kernels/README.md).
"""

from pathlib import Path

_ROOT = Path(__file__).resolve().parents[2]
if (_ROOT / "pyproject.toml").is_file() and (_ROOT / "kernels" / "logprob.py").is_file():
    __path__ = [str(_ROOT / "kernels")]
