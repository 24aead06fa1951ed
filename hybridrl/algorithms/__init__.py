"""The RL math as pure functions: advantage estimators and the critic's loss (advantages.py), DAPO's
batch shaping (dapo.py). The policy losses are kernels, paired with references (kernels/ppo_loss.py)."""
