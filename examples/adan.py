"""Adan (Xie et al. 2022), fused: pytorch-optimizer's ``Adan`` (``previous_grad`` is -g)."""
import math

import flatopt


def adan(p, g, m, v, n, prev, beta2, b1c, b2c, beta3, b3c, eps, proximal, step1, step2,
         bc3_sqrt, later):
    d = (prev + g) * later                       # g - previous g; 0 at the first step
    m, n, prev = m + b1c * (g - m), n + b2c * (d - n), -g  # lerps by 1 - beta1, 1 - beta2
    u = d * beta2 + g
    v = beta3 * v + b3c * u * u
    denominator = math.sqrt(v) / bc3_sqrt + eps
    p = (p - step1 * m / denominator - step2 * n / denominator) / proximal  # proximal decay
    return p, m, v, n, prev


def derived(lr, beta1, beta2, beta3, weight_decay):
    return {"b1c": 1 - beta1, "b2c": 1 - beta2, "b3c": 1 - beta3, "proximal": 1 + lr * weight_decay}


def per_step(step, group_step, lr, beta1, beta2, beta3):  # group_step: as the oracle
    return (lr / (1 - beta1 ** group_step), lr * beta2 / (1 - beta2 ** group_step),
            math.sqrt(1 - beta3 ** group_step), 1.0 if step > 1 else 0.0)


Adan = flatopt.define_optimizer(
    "Adan", adan, state=("exp_avg", "exp_avg_sq", "exp_avg_diff", "previous_grad"),
    derived=derived, per_step=per_step, per_step_values=("step1", "step2", "bc3_sqrt", "later"),
    hyperparameters=dict(lr=1e-3, beta1=0.98, beta2=0.92, beta3=0.99, eps=1e-8, weight_decay=0.0))
