"""KL estimators k1/k2/k3 (Schulman 2020, "Approximating KL divergence"), each of d = clamp(logp_ref -
logp, +-20) per token: the loss's KL term and the KL in the reward use the same ones."""


def _k1(d):
    return -d


def _k2(d):
    return 0.5 * d * d


def _k3(d):
    return (d.expm1() - d).clamp(max=10.0)  # expm1: exact near d = 0, where k3 ~ d^2/2


KL_ESTIMATORS = {"k1": _k1, "k2": _k2, "k3": _k3}
