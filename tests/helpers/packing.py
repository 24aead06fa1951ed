"""The Trainer's log-prob and loss paths on a tiny Qwen2 (sdpa, float32), with the module itself
standing in for DeepSpeed's engine: no engine starts (test_packing, test_tis, test_share_prompt,
test_sequence_parallel)."""

import torch
import transformers

from hybridrl.core.config import Config
from hybridrl.data.batch import Batch
from hybridrl.engines.policy import TokenLogprobs
from hybridrl.engines.trainer import Trainer

V = 40


def tiny_model():
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(
        vocab_size=V,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        intermediate_size=96,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    return transformers.Qwen2ForCausalLM(cfg).float()


def rows() -> Batch:
    """5 samples, prompts of 2..6 tokens and completions of 1..5: lengths 3..11."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, V, (n,), generator=g).tolist() for n in (6, 2, 4, 3, 5)]
    completions = [torch.randint(1, V, (n,), generator=g).tolist() for n in (5, 1, 3, 5, 2)]
    logp_rollout = [(-0.1 * torch.arange(1, len(c) + 1)).tolist() for c in completions]
    return Batch.from_rows(prompts, completions, logp_rollout, [1.0, -0.5, 0.7, -1.2, 0.3])


def trainer(packing: bool) -> Trainer:
    """The real Trainer's log-prob paths, with the module itself standing in for DeepSpeed's engine."""
    t = Trainer.__new__(Trainer)
    t.cfg, t.device, t.packing, t.share_prompt = Config(), torch.device("cpu"), packing, False
    t.engine = TokenLogprobs(tiny_model(), "torch", chunk=7, max_len=5)  # odd chunk: spans samples
    return t


def loss_and_grads(t: Trainer, batch: Batch, tis_level: str | None, agg: str):
    """The trainer's fused loss on `batch` (off-policy: batch.logp_old set; dual clip, entropy bonus, TIS
    at `tis_level`), backpropagated: (loss, logp, {parameter: gradient})."""
    sel = batch.loss_mask
    seq_ids = torch.arange(len(batch))[:, None].expand_as(sel)[sel]  # [N], as Trainer.step builds it
    loss, metrics, logp, entropy = t._forward(
        batch,
        1.0,
        loss=dict(
            logp_old=batch.logp_old[sel],
            advantages=batch.advantages[seq_ids],
            mask=torch.ones(len(seq_ids)),
            seq_ids=seq_ids,
            logp_rollout=batch.logp_rollout[sel] if tis_level else None,
            eps_low=0.2,
            eps_high=0.28,
            dual_clip=3.0,
            tis_cap=2.0 if tis_level else None,
            tis_level=tis_level or "token",
            entropy_coef=0.01,
            agg=agg,
            normalizer=7.0,
        ),
    )
    loss.backward()
    return loss.detach(), logp, {n: p.grad.clone() for n, p in t.engine.named_parameters()}


def assert_same_loss_and_grads(ref, got) -> None:
    (ref_loss, ref_logp, ref_grads), (loss, logp, grads) = ref, got
    assert float(ref_loss) != 0.0
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(logp, ref_logp, rtol=0, atol=1e-5)
    assert len(grads) == len(ref_grads) == 2 + 2 * 12 + 1  # embeddings, head, 2 layers x 12 tensors, final norm
    for name, g in ref_grads.items():
        assert float(g.abs().max()) > 0, name
        torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-6, msg=name)
