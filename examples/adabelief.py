"""AdaBelief (Zhuang et al. 2020) as a fused flatopt optimizer, as pytorch-optimizer's
``AdaBelief`` with its defaults (decoupled weight decay, no rectification)."""
import math

import flatopt


def adabelief(p, g, m, v, beta2, one_minus_beta1, one_minus_beta2, eps, decay, step_size,
              bias_correction2_sqrt):
    p = p * decay                                  # decoupled weight decay
    m = m + one_minus_beta1 * (g - m)              # lerp(m, g, 1 - beta1)
    r = g - m                                      # the "belief": g's distance from m
    v = (beta2 * v + one_minus_beta2 * r * r) + eps
    p = p - step_size * m / (math.sqrt(v) / bias_correction2_sqrt + eps)
    return p, m, v


def derived(lr, beta1, beta2, weight_decay):
    return {"one_minus_beta1": 1 - beta1, "one_minus_beta2": 1 - beta2,
            "decay": 1 - lr * weight_decay}


def bias_corrections(step, group_step, lr, beta1, beta2):  # the group's count, as the oracle
    return lr / (1 - beta1 ** group_step), math.sqrt(1 - beta2 ** group_step)


AdaBelief = flatopt.define_optimizer(
    "AdaBelief", adabelief, state=("exp_avg", "exp_avg_var"), derived=derived,
    hyperparameters={"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-16, "weight_decay": 0.0},
    per_step=bias_corrections, per_step_values=("step_size", "bias_correction2_sqrt"))
