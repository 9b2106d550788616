"""AdaGrad-Norm (Ward, Wu and Bottou 2019, "AdaGrad stepsizes: sharp convergence over
nonconvex landscapes") as a fused flatopt optimizer: one step size per group from the squared
norms of every gradient so far, ``b^2 += ||g||^2``, ``p -= lr / b * g``. The norm is a total
over every parameter of the group (``reduce`` + ``per_group``); ``b^2`` is group state, saved
with the group."""
import math

import flatopt


def squares(p, g):
    return g * g                                   # summed over the group, in float64


def accumulate(grad_norm_sq, b_sq):
    b_sq = b_sq + grad_norm_sq
    return b_sq, 1.0 / math.sqrt(b_sq)


def adagrad_norm(p, g, lr, inv_b):
    return p - (lr * inv_b) * g


AdaGradNorm = flatopt.define_optimizer(
    "AdaGradNorm", adagrad_norm, hyperparameters={"lr": 1.0}, group_state={"b_sq": 1e-4},
    reduce=squares, reduce_values=("grad_norm_sq",), per_group=accumulate,
    per_group_values=("b_sq", "inv_b"))
