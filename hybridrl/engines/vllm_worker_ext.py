"""Mixed into vLLM's worker in its engine-core process (`rollout.mode=outofprocess`), through
`LLM(worker_extension_cls=...)`, and reached with `llm.collective_rpc`. Imported only there.

It reads the hand-off's staging buckets (ipc.BucketReceiver) and loads the weights with the same
vLLM call as the in-process path (vllm_compat.load_into_worker, or load_adapter_into_worker for
a LoRA adapter): the one place that knows vLLM's
loader stays vllm_compat.py.
"""

from __future__ import annotations

from hybridrl.engines import ipc, vllm_compat


class WeightReceiver:
    def hybridrl_receive_weights(
        self, address: str, digest: bool = False, timeout_s: float = ipc.TIMEOUT_S, adapter: dict | None = None
    ) -> dict:
        """Load every tensor sent to `address`; returns what arrived (and sha256s if `digest`).
        Raises (and the RPC returns) after `timeout_s` without a message, or when the sender aborts.
        With `adapter` (LoRA's config) the tensors are the policy's adapter, not weights."""
        receiver = ipc.BucketReceiver(address, self.model_runner.device, digest=digest, timeout_s=timeout_s)
        if adapter:
            vllm_compat.load_adapter_into_worker(self, receiver, adapter)
        else:
            vllm_compat.load_into_worker(self, receiver)
        return receiver.report
