"""The planner's inputs: an H100's and a node's bytes, the shapes of shipped model configs, and a run's
config as `hybridrl train` resolves it on a GPU (test_plan, test_gpu_path_decisions)."""

from hybridrl.core import config, recipe
from hybridrl.cycle import plan
from hybridrl.cycle.shape import Shape, info_of, read_config

GIB = 1 << 30


H100 = int(plan.DEFAULT_GPU_GIB * GIB)


NODE = int(plan.DEFAULT_HOST_GIB * GIB)


def shape(name: str) -> Shape:
    return Shape.from_config(read_config(name))


def gpu_config(model: str, world: int, **over) -> config.Config:
    """A run's config as `hybridrl train` resolves it on a GPU (the real-model recipe)."""
    cfg = recipe.auto_dtype(config.load(None, {"model.path": model, **over}), on_cpu=False)
    conf = read_config(model)
    return recipe.resolve(cfg, info_of(model, conf, Shape.from_config(conf)), on_cpu=False, world_size=world)
