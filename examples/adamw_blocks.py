"""AdamW (torch.optim.AdamW) from the public API and flatopt.blocks: the built-in AdamW's
arithmetic, rounded as torch rounds it, so both give the same bits."""
import math

import flatopt
from flatopt.blocks import bias_correction, lerp, square_ema


def adamw(p, g, m, v, decay, one_minus_beta1, beta2, one_minus_beta2, eps, neg_step_size,
          bias_correction2_sqrt):
    p = p * decay                                   # decoupled weight decay
    m = lerp(m, g, one_minus_beta1)                 # torch's exp_avg.lerp_(grad, 1 - beta1)
    v = square_ema(v, g, beta2, one_minus_beta2)    # exp_avg_sq.mul_(beta2).addcmul_(...)
    p = p + (neg_step_size * m) / (math.sqrt(v) / bias_correction2_sqrt + eps)
    return p, m, v


def derived(lr, beta1, beta2, weight_decay):
    return {"decay": 1 - lr * weight_decay, "one_minus_beta1": 1 - beta1,
            "one_minus_beta2": 1 - beta2}


def bias_corrections(step, lr, beta1, beta2):      # the parameter's own count, as torch
    return -(lr / bias_correction(beta1, step)), bias_correction(beta2, step) ** 0.5


BlocksAdamW = flatopt.define_optimizer(
    "BlocksAdamW", adamw, state=("exp_avg", "exp_avg_sq"), derived=derived,
    hyperparameters={"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 1e-2},
    per_step=bias_corrections, per_step_values=("neg_step_size", "bias_correction2_sqrt"))
