"""The hybrid engine's memory life cycle, on CPU: the phase order (a state machine driven through
the real engine_cycle and Rollout verbs, with a recording stand-in for vLLM), the allocator
checker and toggle, the bucketed shared-memory transport (bitwise),
DeepSpeed's offload/reload of the training states, and a checkpoint saved from offloaded states
(real DeepSpeed)."""

import multiprocessing as mp
from pathlib import Path

import pytest
import torch

import hybridrl
from hybridrl.core import config, memory
from hybridrl.core.config import ConfigError
from hybridrl.cycle import engine_cycle
from hybridrl.engines import ipc, vllm_compat
from hybridrl.engines.seams import Engines

from helpers.memory import FakeTrainer, four_rows

GIB = 1 << 30
DEMO = str(Path(hybridrl.__file__).parent / "demo_model")


# --- the phase order ---------------------------------------------------------------------------
class FakeLLM:
    """Records what vLLM is asked to do."""

    def __init__(self, events):
        self.events = events

    def wake_up(self, tags):
        self.events.append(("vllm.wake_up", tuple(tags)))

    def sleep(self, level):
        self.events.append(("vllm.sleep", level))

    def reset_prefix_cache(self):
        self.events.append(("vllm.reset_prefix_cache",))


def real_rollout(events, monkeypatch):
    """hybridrl's own Rollout verbs (wake, sleep, update_weights) over the recording vLLM, with
    sleep mode on as on a GPU."""
    from hybridrl.engines.rollout import Rollout

    r = Rollout.__new__(Rollout)
    r.llm, r.cuda, r.sleep_ok, r.sender, r.digest = FakeLLM(events), False, True, None, False
    r.asleep = r.weights_lost = False
    r.adapter = r.lora_request = None  # full weights (no LoRA)
    monkeypatch.setattr(
        vllm_compat, "load_weights", lambda llm, named: events.append(("vllm.load", tuple(n for n, _ in named)))
    )
    return r


def one_step(trainer, rollout, cfg, events):
    """What loop.train does around generation, in its order."""
    events.append(("generate",))
    engine_cycle.release(Engines(trainer, rollout), None, cfg=cfg)
    events.append(("train",))
    engine_cycle.hand_off(Engines(trainer, rollout), None, cfg=cfg, cuda=False)


@pytest.mark.fast
@pytest.mark.parametrize("level", [1, 2])
@pytest.mark.parametrize("offload_params", [False, True])
def test_phase_order(monkeypatch, level, offload_params):
    events = []
    cfg = config.load(
        None, {"rollout.sleep_level": level, "train.offload_params": offload_params, "train.probe_every": 0}
    )
    trainer, rollout = FakeTrainer(events), real_rollout(events, monkeypatch)
    engine_cycle.hand_off(Engines(trainer, rollout), None, cfg=cfg, cuda=False)  # a freshly built engine is awake
    events.clear()
    one_step(trainer, rollout, cfg, events)
    one_step(trainer, rollout, cfg, events)
    step = [
        ("generate",),
        ("vllm.sleep", level),
        ("trainer.reload",),
        ("train",),
        ("trainer.offload", False),
        ("vllm.wake_up", ("weights",)),
        ("vllm.load", tuple(FakeTrainer.names)),  # every parameter, every hand-off
        ("vllm.reset_prefix_cache",),
    ]
    step += [("trainer.offload", True)] if offload_params else []
    step += [("vllm.wake_up", ("kv_cache",))]
    assert events == step + step
    loads = [i for i, e in enumerate(events) if e[0] == "vllm.load"]
    kv = [i for i, e in enumerate(events) if e == ("vllm.wake_up", ("kv_cache",))]
    assert all(k > w for k, w in zip(kv, loads))  # the KV cache wakes only after the hand-off
    assert not rollout.weights_lost and not rollout.asleep


@pytest.mark.fast
def test_level_two_sleep_forces_a_hand_off(monkeypatch):
    events = []
    rollout = real_rollout(events, monkeypatch)
    rollout.sleep(2)
    assert rollout.weights_lost  # vLLM discarded its weights
    rollout.wake(["weights"])
    with pytest.raises(RuntimeError, match="discarded by a level-2 sleep"):
        rollout.wake(["kv_cache"])  # e.g. an evaluation right after sleeping: refused
    rollout.update_weights(FakeTrainer(events).named_parameters_for_sync(0))
    rollout.wake(["kv_cache"])
    assert events[-1] == ("vllm.wake_up", ("kv_cache",)) and not rollout.weights_lost
    rollout.sleep(1)
    assert not rollout.weights_lost  # level 1 keeps them in CPU memory


@pytest.mark.fast
def test_cpu_rollout_verbs_are_no_ops(monkeypatch):
    events = []
    rollout = real_rollout(events, monkeypatch)
    rollout.sleep_ok = False  # vllm_compat.sleep_supported(on_cpu=True)
    rollout.sleep(2)
    rollout.wake(["weights"])
    rollout.wake(["kv_cache"])
    assert events == [] and not rollout.weights_lost
    assert vllm_compat.sleep_supported(on_cpu=True) is False


# --- expandable segments -----------------------------------------------------------------------
@pytest.mark.fast
def test_training_default_only_when_the_user_chose_nothing():
    assert memory.training_defaults({}, cuda=True) == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert memory.training_defaults({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}, cuda=True) == {}
    assert memory.training_defaults({"PYTORCH_ALLOC_CONF": "expandable_segments:False"}, cuda=True) == {}
    assert memory.training_defaults({}, cuda=False) == {}


@pytest.mark.fast
@pytest.mark.parametrize(
    "env,match",
    [
        ({"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"}, "remove backend:cudaMallocAsync"),
        ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:true"}, "must be True or False"),
        ({"PYTORCH_NO_CUDA_MEMORY_CACHING": "1"}, "unset it"),
        (
            {"PYTORCH_ALLOC_CONF": "expandable_segments:yes", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
            "PYTORCH_ALLOC_CONF=expandable_segments:yes",
        ),  # torch reads PYTORCH_ALLOC_CONF first
    ],
)
def test_allocator_settings_that_break_sleep_mode(env, match):
    cfg = config.load()
    with pytest.raises(ConfigError, match=match) as e:
        memory.check_alloc_conf(env, cfg)
    assert "rollout.sleep_level=0" in str(e.value) or "True or False" in str(e.value)
    if "backend" in str(env) or "NO_CUDA" in str(env):
        memory.check_alloc_conf(env, config.load(None, {"rollout.sleep_level": 0}))  # sleep mode off: fine


@pytest.mark.fast
def test_allocator_settings_sleep_mode_lives_with():
    cfg = config.load()
    for env in (
        {},
        {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True,max_split_size_mb:512"},
        {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"},
        {"PYTORCH_CUDA_ALLOC_CONF": "backend:native"},
    ):
        memory.check_alloc_conf(env, cfg)
    with pytest.raises(ConfigError, match="cannot switch expandable_segments off at run time"):
        memory.check_alloc_conf({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, cfg, can_toggle=False)


@pytest.mark.fast
def test_vllm_pool_switches_expandable_segments_off_and_back(monkeypatch):
    # torch's CPU build keeps the allocator settings string, so the real toggle runs here
    user = "max_split_size_mb:512,expandable_segments:True"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", user)
    torch._C._accelerator_setAllocatorSettings(user)
    try:
        with memory.vllm_pool(cuda=True):
            inside = "max_split_size_mb:512,expandable_segments:False"  # the user's other option kept
            assert torch._C._accelerator_getAllocatorSettings() == inside
            import os

            assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == inside  # what a spawned engine inherits
            with memory.vllm_pool(cuda=True):  # nested (wake inside the hand-off): stays off
                assert torch._C._accelerator_getAllocatorSettings() == inside
            assert torch._C._accelerator_getAllocatorSettings() == inside
        assert torch._C._accelerator_getAllocatorSettings() == user
        assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == user
        with memory.vllm_pool(cuda=False):  # CPU: nothing changes
            assert torch._C._accelerator_getAllocatorSettings() == user
    finally:
        torch._C._accelerator_setAllocatorSettings("")


# --- the planner's decision in the phase order (its arithmetic: test_planner.py) ----------------
@pytest.mark.fast
def test_states_stay_when_planned_off(monkeypatch):
    """train.offload_states=off (what the planner decides when both engines fit): the hand-off
    leaves the trainer's states where they are; the rest of the order is unchanged."""
    events = []
    cfg = config.load(None, {"train.offload_states": "off", "rollout.sleep_level": 2})
    one_step(FakeTrainer(events), real_rollout(events, monkeypatch), cfg, events)
    assert ("trainer.offload", False) not in events
    assert [e[0] for e in events][:3] == ["generate", "vllm.sleep", "trainer.reload"]


# --- the bucketed shared-memory transport ------------------------------------------------------
def _tensors():
    from safetensors.torch import load_file

    named = sorted(load_file(f"{DEMO}/model.safetensors").items())
    g = torch.Generator().manual_seed(0)
    named += [
        ("odd.bf16", torch.randn(999, generator=g).bfloat16()),  # 2 bytes/element, odd count
        ("odd.transposed", torch.randn(33, 65, generator=g).t()),  # not contiguous
        ("odd.int64", torch.arange(5)),
        ("odd.empty", torch.zeros(0)),
    ]
    return named


def test_bucketed_shared_memory_hand_off_is_bitwise():
    named = _tensors()
    largest = max(t.numel() * t.element_size() for _, t in named)
    assert largest == 196608  # an MLP weight of the demo model: 128 x 384 fp32
    ctx = mp.get_context("spawn")
    addresses, results = ctx.Queue(), ctx.Queue()
    from ipc_peer import receive_many

    proc = ctx.Process(target=receive_many, args=(addresses, results), daemon=True)
    proc.start()

    def rpc(address, digest, timeout_s):
        addresses.put(address)
        return results.get(timeout=120)

    try:
        # smaller than the largest parameter (split across fills), larger, and one per parameter
        for bucket, messages in [(100_000, None), (4 << 20, 1), (0, len(named))]:
            sender = ipc.BucketSender(bucket, cuda=False)
            report = sender.send(iter(named), rpc, digest=True)
            sender.close()
            assert report["names"] == [n for n, _ in named]  # every tensor, in order
            for name, t in named:
                assert report["digests"][name] == ipc.digest(t), (bucket, name)
            total = sum(t.numel() * t.element_size() for _, t in named)
            assert report["bytes"] == report["sent"]["bytes"] == total
            if messages:
                assert report["messages"] == messages
            else:  # 100 kB buckets: at least total/100k fills, the largest tensors spanning two
                assert report["messages"] >= total // bucket
    finally:
        addresses.put(None)
        proc.join(60)


# --- DeepSpeed's offload and reload of the training states ------------------------------------
@pytest.mark.parametrize("zero", [2, 3])
def test_offload_reload_keeps_training_bitwise(zero, world_of_one):
    """The trainer verbs' DeepSpeed calls (offload_states with optimizer states, fp32 master,
    gradients and parameters; reload_states) run here from CPU to CPU: training continues
    bit for bit as without them. On a GPU the same calls move the states to pinned host memory."""
    from hybridrl.engines.trainer import Trainer

    def train(offload):
        torch.manual_seed(0)
        cfg = config.load(None, {"train.zero_stage": zero})
        trainer = Trainer(cfg, DEMO, device=torch.device("cpu"), dtype=torch.float32, attn_implementation="sdpa")
        batch = four_rows()
        if offload:  # the loop offloads once before the first step (engine_cycle.plan_rollout)
            trainer._offload_states(params=False)
            trainer._reload_states()
        for _ in range(2):
            trainer.step(batch)
            if offload:
                trainer._offload_states(params=False)  # before the hand-off
                trainer._offload_states(params=True)  # after it (train.offload_params)
                assert {s.value for s in trainer.engine.optimizer.offloaded_states} >= {
                    "optim_states",
                    "hp_params",
                    "lp_grads",
                    "lp_params",
                }
                trainer._reload_states()
                assert not trainer.engine.optimizer.offloaded_states
        return {n: p.clone() for n, p in trainer.named_parameters_for_sync(1 << 20)}

    plain, cycled = train(False), train(True)
    assert plain.keys() == cycled.keys() and all(torch.equal(plain[n], cycled[n]) for n in plain)


@pytest.mark.parametrize("zero", [2, 3])
def test_checkpoint_is_saved_from_offloaded_states(zero, world_of_one, tmp_path, monkeypatch):
    """The loop saves after the hand-off: the policy's training states and the whole critic are
    offloaded, vLLM's KV cache is awake. Saver.save (real trainer, real critic, real DeepSpeed)
    must save them from there: no reload verb and no DeepSpeed reload_states runs, the engines are
    still offloaded afterwards, and the saved states continue training bit for bit. DeepSpeed's
    offload_states runs CPU->CPU here: the same bookkeeping as a GPU's move to host memory."""
    from types import SimpleNamespace

    from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum
    from transformers import AutoTokenizer

    from hybridrl.core.launch import World
    from hybridrl.data.batch import Batch
    from hybridrl.engines.critic import Critic
    from hybridrl.engines.trainer import Trainer
    from hybridrl.run import checkpoint

    cpu = torch.device("cpu")
    cfg = config.load(None, {"train.zero_stage": zero, "algo.advantage": "gae", "ckpt.dir": str(tmp_path / "ck")})
    g = torch.Generator().manual_seed(1)
    batch = Batch.from_rows(
        [[1, 2, 3]] * 4,
        [torch.randint(3, 12, (4,), generator=g).tolist() for _ in range(4)],
        [[-1.0] * 4] * 4,
        [1.0, -1.0, 0.5, -0.5],
    )

    def engines():
        torch.manual_seed(0)
        kw = dict(device=cpu, dtype=torch.float32, attn_implementation="sdpa")
        return Trainer(cfg, DEMO, **kw), Critic(cfg, DEMO, **kw)

    def train(trainer, critic):
        trainer.step(batch)
        batch.values = critic.values(batch)
        batch.returns = batch.values + batch.loss_mask.float()  # [B, T]
        critic.step(batch)

    def state(trainer, critic):  # every parameter of both engines, gathered under ZeRO-3
        import deepspeed

        out = {f"policy.{n}": p.clone() for n, p in trainer.named_parameters_for_sync(1 << 20)}
        params = list(critic.engine.module.named_parameters())
        with deepspeed.zero.GatheredParameters([p for _, p in params], enabled=zero == 3):
            out.update({f"critic.{n}": p.detach().clone() for n, p in params})
        return out

    trainer, critic = engines()
    train(trainer, critic)
    trainer._offload_states(params=False)  # what engine_cycle.hand_off does on a GPU
    critic.engine.offload_states(device=OffloadDeviceEnum.cpu, pin_memory=False)  # what Critic.offload does there
    offloaded = (set(trainer.engine.optimizer.offloaded_states), set(critic.engine.optimizer.offloaded_states))
    assert "hp_params" in {s.value for s in offloaded[0]} and "optim_states" in {s.value for s in offloaded[1]}
    reloads = []
    saver = checkpoint.Saver(cfg, tmp_path, World(0, 1, 0, cpu), AutoTokenizer.from_pretrained(DEMO))
    with pytest.MonkeyPatch.context() as spy:  # record every way back onto the device
        for obj in (trainer, critic, trainer.engine, critic.engine):
            for verb in ("reload", "reload_states"):
                if hasattr(obj, verb):
                    real = getattr(obj, verb)
                    spy.setattr(
                        obj,
                        verb,
                        lambda *a, _r=real, _n=f"{type(obj).__name__}.{verb}", **k: (reloads.append(_n), _r(*a, **k))[
                            1
                        ],
                    )
        ck = saver.save(
            1, Engines(trainer, critic=critic), SimpleNamespace(cursor=0), SimpleNamespace(last=None, tol=2e-2), {}
        )
    assert ck is not None and checkpoint.is_complete(ck)
    assert reloads == []  # nothing came back onto the device for the save
    assert (set(trainer.engine.optimizer.offloaded_states), set(critic.engine.optimizer.offloaded_states)) == offloaded

    trainer._reload_states()
    critic.engine.reload_states()
    train(trainer, critic)  # the run goes on
    resumed = engines()
    resumed[0].load_checkpoint(str(ck), checkpoint.DS_TAG)
    resumed[1].load_checkpoint(str(ck))
    train(*resumed)  # the same step from the checkpoint
    ours, theirs = state(trainer, critic), state(*resumed)
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


@pytest.mark.parametrize("zero", [2, 3])
def test_critic_offload_reaches_deepspeed(zero, world_of_one):
    """The critic's offload and reload go through DeepSpeed's offload_states with the device as
    OffloadDeviceEnum (a "cpu" string fails in both ZeRO optimizers with 'str' object has no
    attribute 'value'): every state leaves, then comes back, CPU to CPU here."""
    from hybridrl.engines.critic import Critic
    from hybridrl.engines.deepspeed_compat import offload_states, reload_states

    cfg = config.load(None, {"train.zero_stage": zero, "algo.advantage": "gae"})
    critic = Critic(cfg, DEMO, device=torch.device("cpu"), dtype=torch.float32, attn_implementation="sdpa")
    offload_states(critic.engine)  # what Critic.offload calls on a GPU
    assert {s.value for s in critic.engine.optimizer.offloaded_states} >= {"optim_states", "hp_params", "lp_params"}
    reload_states(critic.engine)
    assert not critic.engine.optimizer.offloaded_states


def test_pending_state_bytes(world_of_one):
    """Adam's two fp32 moments do not exist until the first step: the planner counts them."""
    from hybridrl.data.batch import Batch
    from hybridrl.engines.trainer import Trainer

    trainer = Trainer(
        config.load(None, {}), DEMO, device=torch.device("cpu"), dtype=torch.float32, attn_implementation="sdpa"
    )
    n = sum(p.numel() for p in trainer.hf.parameters())
    assert trainer.pending_state_bytes() == 8 * n
    trainer.step(Batch.from_rows([[1, 2, 3]] * 2, [[4, 5]] * 2, [[-1.0] * 2] * 2, [1.0, -1.0]))
    assert trainer.pending_state_bytes() == 0


def test_a_trainer_after_the_world_group_was_destroyed_outside_deepspeed(world_of_one):
    """DeepSpeed caches its clone of the world group; an in-process vLLM engine's teardown (a notebook's
    earlier run, a test) can destroy the group under it, and the next DeepSpeed engine then failed
    with "Group ... is not registered" (found when a new vLLM test ran before this file in CI).
    zero_engine.from_pretrained drops the stale clone first."""
    import torch.distributed as dist

    from hybridrl.core import launch
    from hybridrl.engines.trainer import Trainer

    def trainer():
        return Trainer(
            config.load(None, {}), DEMO, device=torch.device("cpu"), dtype=torch.float32, attn_implementation="sdpa"
        )

    del trainer().engine  # an earlier engine in this process: DeepSpeed clones the world group
    dist.destroy_process_group()  # what the teardown does, outside DeepSpeed
    launch.init_distributed()  # the next run's world of one
    assert trainer().pending_state_bytes() > 0
