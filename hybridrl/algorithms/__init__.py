"""The RL math as pure functions, each algorithm component declared once where it is defined
(registry.py): the policy losses (losses/, one module each), the advantage estimators
(estimators.py), the KL estimators (kl.py); applied to a rollout batch, with the critic's loss, in
advantages.py; DAPO's batch shaping in dapo.py. Importing the package registers every declaration
without importing torch (the config reads them). The fused kernels that compute the losses are
kernels/, paired with the reference (kernels/ppo_loss.py)."""

from hybridrl.algorithms import estimators, losses  # noqa: F401  (each registers its declarations)
from hybridrl.algorithms.registry import ESTIMATORS, POLICY_LOSSES, estimator, policy_loss  # noqa: F401
