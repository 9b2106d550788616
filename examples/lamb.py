"""LAMB (You et al. 2020) as a fused flatopt optimizer, as pytorch-optimizer's ``Lamb`` with
its defaults: decoupled weight decay, the first moment's bias correction in the step size, the
trust ratio ||p|| / ||u|| (||p|| clamped at 10) of each parameter tensor, from a reduce pass
over its elements."""
import math

import flatopt


def direction(m, v, g, beta1, beta2, one_minus_beta1, one_minus_beta2, eps):
    m = beta1 * m + one_minus_beta1 * g
    v = beta2 * v + one_minus_beta2 * g * g
    return m / (math.sqrt(v) + eps), m, v


def norms(p, g, m, v, beta1, beta2, one_minus_beta1, one_minus_beta2, eps, decay):
    u, m, v = direction(m, v, g, beta1, beta2, one_minus_beta1, one_minus_beta2, eps)
    return (p * decay) * (p * decay), u * u      # summed per tensor, in float64


def corrected_lr(step, group_step, lr, beta1):  # the group's count, as the oracle
    return lr / (1 - beta1 ** group_step)


def trust_ratio(param_sq, update_sq, lr_t, eps):
    weight_norm, update_norm = min(math.sqrt(param_sq), 10.0), math.sqrt(update_sq)
    if weight_norm == 0 or update_norm == 0:
        return lr_t
    return lr_t * weight_norm / (update_norm + eps)


def lamb(p, g, m, v, beta1, beta2, one_minus_beta1, one_minus_beta2, eps, decay, step_size):
    u, m, v = direction(m, v, g, beta1, beta2, one_minus_beta1, one_minus_beta2, eps)
    return p * decay - step_size * u, m, v


def derived(lr, beta1, beta2, weight_decay):
    return {"one_minus_beta1": 1 - beta1, "one_minus_beta2": 1 - beta2,
            "decay": 1 - lr * weight_decay}


Lamb = flatopt.define_optimizer(
    "Lamb", lamb, state=("exp_avg", "exp_avg_sq"), derived=derived,
    hyperparameters={"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-6, "weight_decay": 0.0},
    per_step=corrected_lr, per_step_values=("lr_t",), reduce=norms, reduce_values=("param_sq", "update_sq"),
    per_tensor=trust_ratio, per_tensor_values=("step_size",))
