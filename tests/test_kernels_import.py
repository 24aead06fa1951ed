"""Hugging Face's `kernels` distribution (transformers probes it for hub kernels) installed beside
hybridrl: each import gets its own package, from the repository root too (where `python -c` and
`python -m pytest` put the working directory first on the path)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHECK = f"""
import kernels
import hybridrl.kernels.logprob as lp, hybridrl.kernels.ppo_loss, hybridrl.kernels.fused_loss
from transformers.utils import is_kernels_available
assert hasattr(kernels, "get_kernel"), f"`import kernels` is not Hugging Face's: {{kernels.__path__}}"
assert is_kernels_available(), "transformers does not see Hugging Face's kernels"
assert lp.__file__.startswith({str(ROOT / "kernels")!r}) or lp.__file__.startswith({str(ROOT / "hybridrl")!r}), lp.__file__
import torch, transformers
cfg = transformers.Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                               num_attention_heads=2, num_key_value_heads=1)
model = transformers.AutoModelForCausalLM.from_config(cfg)
h = model.model(torch.tensor([[1, 2, 3]])).last_hidden_state
out = lp.logprob_entropy_reference(h[0], model.lm_head.weight, torch.tensor([2, 3, 4]))
print("ok", type(out).__name__)
"""  # noqa: E501 - the script's lines are run as they are


def test_hf_kernels_and_hybridrl_kernels_import_side_by_side():
    import importlib.metadata

    assert importlib.metadata.version("kernels"), "the test extra installs Hugging Face's kernels"
    out = subprocess.run([sys.executable, "-c", CHECK], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-2000:]


def test_no_top_level_kernels_package_ships():
    """kernels/ has no __init__.py: a regular package there would shadow Hugging Face's from the
    repository root; it is installed as hybridrl.kernels only. hybridrl/kernels is a folder, not a
    link (tools and packaging tripped on the link it was), whose __init__ points the package at
    kernels/ in a checkout."""
    assert not (ROOT / "kernels" / "__init__.py").exists()
    assert not (ROOT / "hybridrl" / "kernels").is_symlink()
    import hybridrl.kernels
    import hybridrl.kernels.logprob

    assert [Path(p) for p in hybridrl.kernels.__path__] == [ROOT / "kernels"]
    assert Path(hybridrl.kernels.logprob.__file__).parent == ROOT / "kernels"


def test_the_wheel_holds_the_kernels_under_hybridrl(tmp_path):
    """A wheel built from the checkout holds kernels/ as hybridrl/kernels/ (pyproject's package-dir),
    no top-level `kernels`, and not the checkout's pointer file."""
    import zipfile

    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    src = tmp_path / "src"
    for name in files.decode().split("\0"):
        if name and (ROOT / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            (src / name).write_bytes((ROOT / name).read_bytes())
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path / "whl"),
            str(src),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    (wheel,) = (tmp_path / "whl").glob("hybridrl-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    kernels = sorted(n for n in names if "kernels/" in n)
    assert kernels == sorted(f"hybridrl/kernels/{p.name}" for p in (ROOT / "kernels").glob("*.py")), kernels
    assert not any(n.startswith("kernels/") for n in names)
