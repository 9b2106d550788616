"""Schedule-Free SGD (Defazio et al. 2024) as a fused flatopt optimizer, with constant lr (no
warm-up): the parameters hold y, the state z starts at the parameter's value, and x (the
average to evaluate) is reached by ``opt.eval()``; ``opt.train()`` goes back to y."""
import flatopt


def weights(step, group_step, lr, momentum):   # ckp1 = 1/k with a constant lr
    ckp1 = 1.0 / group_step
    return ckp1, lr * (momentum * (1.0 - ckp1) - 1.0)


def sf_sgd(p, g, z, ckp1, y_lr, lr):
    p = p + ckp1 * (z - p)                         # y = lerp(y, z, ckp1)
    return p + y_lr * g, z - lr * g


def to_x(p, z, eval_weight):
    return p + eval_weight * (z - p), z


def to_y(p, z, train_weight):
    return p + train_weight * (z - p), z


def derived(momentum):
    return {"eval_weight": 1.0 - 1.0 / momentum, "train_weight": 1.0 - momentum}


SFSGD = flatopt.define_optimizer(
    "SFSGD", sf_sgd, state=("z",), from_param=("z",), derived=derived,
    hyperparameters={"lr": 1.0, "momentum": 0.9}, per_step=weights,
    per_step_values=("ckp1", "y_lr"), to_eval=to_x, to_train=to_y)
