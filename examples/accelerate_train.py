"""Train hybridrl under `accelerate launch`: the launcher starts the ranks, hybridrl does the rest.

    # CPU, two ranks over gloo (`--cpu --num_processes 2` would start only one process)
    accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no \
        --dynamo_backend no examples/accelerate_train.py train.steps=20
    # one node of 8 GPUs
    accelerate launch --multi_gpu --num_processes 8 examples/accelerate_train.py \
        --config examples/recipes/qwen2.5-7b-8xh100.yaml data.path=train.jsonl

Arguments are `group.field=value` overrides, optionally after `--config FILE`. hybridrl reads
RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR from the launcher (hybridrl.core.launch.init_distributed),
creates the process group both engines need (gloo on CPU, gloo + NCCL on GPU) and builds its own
DeepSpeed engine, so no `Accelerator` or `PartialState` is involved: an accelerate-made group
would be NCCL-only on GPU, which the loop's CPU-side collectives cannot use. The group is gone
when `hybridrl.train` returns.
"""

import os
import sys

import hybridrl


def main(argv: list[str]) -> dict:
    config = None
    if argv[:1] == ["--config"]:
        config, argv = argv[1], argv[2:]
    overrides = dict(arg.split("=", 1) for arg in argv)
    summary = hybridrl.train(config or hybridrl.Config(), overrides={"train.steps": 100, **overrides})
    if os.environ.get("RANK", "0") == "0":  # every rank returns the same summary
        print(
            f"{os.environ.get('WORLD_SIZE', '1')} ranks: held-out accuracy {summary['heldout_acc_before']:.1%} -> "
            f"{summary['heldout_acc_after']:.1%} in {summary['minutes']:.1f} min (run dir {summary['run_dir']})",
            flush=True,
        )
    return summary


if __name__ == "__main__":
    main(sys.argv[1:])
