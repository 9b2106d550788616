"""An independent NumPy reference of each update rule, one parameter at a time.

Written from torch.optim's documented order of operations (../shared/reference/
torch_optim_semantics.md), sharing no code with flatopt's kernels, so the conformance suite is
meaningful without torch. Arithmetic is done in the parameter's dtype; scalars are formed in
Python double and rounded once to that dtype, as torch does.
"""

from __future__ import annotations

import numpy as np


class ReferenceOptimizer:
    """``groups``: list of (dict path -> array, hyperparameters dict). ``kind``: a registry
    name with a rule in ``RULES``."""

    def __init__(self, kind: str, groups):
        if kind not in RULES and kind not in STEPS:
            raise LookupError(f"no NumPy reference for {kind!r}: add its update rule to "
                              "tests/reference.py (RULES)")
        self.kind = kind
        self.rule = RULES.get(kind)
        self.groups = [({k: v.copy() for k, v in params.items()}, dict(hp)) for params, hp in groups]
        self.state: dict[str, dict] = {}
        initial = INITIAL_STATE.get(kind)
        if initial is not None:  # eager state: every parameter has state from the start
            for params, hp in self.groups:
                for path, p in params.items():
                    self.state[path] = initial(p, hp)

    @property
    def params(self) -> dict[str, np.ndarray]:
        return {k: v for params, _ in self.groups for k, v in params.items()}

    def step(self, grads: dict[str, np.ndarray]) -> None:
        whole = STEPS.get(self.kind)
        if whole is not None:  # a rule over every group at once
            whole(self, grads)
            return
        begin = GROUP_STEP.get(self.kind)
        for params, hp in self.groups:
            if begin is not None:  # per-group counters, advanced whatever is present
                begin(hp)
            for path, p in params.items():
                g = grads.get(path)
                if g is None:
                    continue  # a missing gradient skips the parameter entirely
                params[path] = self.rule(self.state.setdefault(path, {}), p, g, hp)


def sgd(state, p, g, hp):
    t = p.dtype.type
    g = -g if hp["maximize"] else g.copy()
    if hp["weight_decay"] != 0:
        g = g + t(hp["weight_decay"]) * p
    if hp["momentum"] != 0:
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = g.copy()
        else:
            buf = state["momentum_buffer"]
            state["momentum_buffer"] = buf * t(hp["momentum"]) + t(1 - hp["dampening"]) * g
        buf = state["momentum_buffer"]
        g = g + t(hp["momentum"]) * buf if hp["nesterov"] else buf
    return p + t(-hp["lr"]) * g

def adam(state, p, g, hp, decoupled=False):
    t = p.dtype.type
    beta1, beta2 = hp["betas"]
    lr, wd = hp["lr"], hp["weight_decay"]
    if not state:
        state.update(step=0, exp_avg=np.zeros_like(p), exp_avg_sq=np.zeros_like(p))
    if hp["amsgrad"] and "max_exp_avg_sq" not in state:
        state["max_exp_avg_sq"] = np.zeros_like(p)
    g = -g if hp["maximize"] else g.copy()
    state["step"] += 1
    if wd != 0:
        if decoupled:
            p = p * t(1 - lr * wd)
        else:
            g = g + t(wd) * p
    weight, m = t(1 - beta1), state["exp_avg"]
    # torch's lerp works from the nearer end: m + w(g - m), or g + (w - 1)(g - m) for w >= .5
    m = state["exp_avg"] = (m + weight * (g - m) if abs(weight) < 0.5
                            else g + (weight - t(1)) * (g - m))
    v = state["exp_avg_sq"] = state["exp_avg_sq"] * t(beta2) + t(1 - beta2) * g * g
    step = float(state["step"])
    step_size = lr / (1 - beta1 ** step)
    bias_correction2_sqrt = (1 - beta2 ** step) ** 0.5
    if hp["amsgrad"]:
        state["max_exp_avg_sq"] = np.maximum(state["max_exp_avg_sq"], v)
        v = state["max_exp_avg_sq"]
    denom = np.sqrt(v) / t(bias_correction2_sqrt) + t(hp["eps"])
    if hp["caution"]:
        m = m * _caution_mask(m, g)
    return p + (t(-step_size) * m) / denom


def adamw(state, p, g, hp):
    return adam(state, p, g, hp, decoupled=True)


def _caution_mask(update, g):
    """timm's cautious mask ("Cautious Optimizers", arXiv 2411.16085), as its optimizers write
    it: ``mask = (update * grad > 0).to(grad.dtype); mask.div_(mask.mean().clamp_(min=1e-3))``
    (the mean over the whole parameter, in its dtype)."""
    t = g.dtype.type
    mask = (update * g > 0).astype(g.dtype)
    if mask.size == 0:
        return mask
    return mask / np.maximum(mask.mean(dtype=g.dtype), t(1e-3))


def _lerp(start, end, weight):
    """torch's lerp from the nearer end (``weight`` already in the dtype)."""
    if abs(weight) < 0.5:
        return start + weight * (end - start)
    return end + (weight - weight.dtype.type(1)) * (end - start)


def _torch_sign(x):
    """torch.sign on the CPU: 0 for 0 and for NaN."""
    t = x.dtype.type
    return np.where(x > 0, t(1), np.where(x < 0, t(-1), t(0)))


def adamax(state, p, g, hp):
    t = p.dtype.type
    beta1, beta2 = hp["betas"]
    if not state:
        state.update(step=0, exp_avg=np.zeros_like(p), exp_inf=np.zeros_like(p))
    g = -g if hp["maximize"] else g.copy()
    state["step"] += 1
    if hp["weight_decay"] != 0:
        g = g + t(hp["weight_decay"]) * p
    m = state["exp_avg"] = _lerp(state["exp_avg"], g, t(1 - beta1))
    # torch.maximum(exp_inf * beta2, |g| + eps), NaN propagating
    u = state["exp_inf"] = np.maximum(state["exp_inf"] * t(beta2), np.abs(g) + t(hp["eps"]))
    clr = hp["lr"] / (1 - beta1 ** float(state["step"]))
    return p + (t(-clr) * m) / u


def radam(state, p, g, hp):
    t = p.dtype.type
    beta1, beta2 = hp["betas"]
    lr, wd = hp["lr"], hp["weight_decay"]
    if not state:
        state.update(step=0, exp_avg=np.zeros_like(p), exp_avg_sq=np.zeros_like(p))
    g = -g if hp["maximize"] else g.copy()
    state["step"] += 1
    step = float(state["step"])
    if wd != 0:
        if hp["decoupled_weight_decay"]:
            p = p * t(1 - lr * wd)
        else:
            g = g + t(wd) * p
    m = state["exp_avg"] = _lerp(state["exp_avg"], g, t(1 - beta1))
    v = state["exp_avg_sq"] = state["exp_avg_sq"] * t(beta2) + t(1 - beta2) * g * g
    bias_correction1 = 1 - beta1 ** step
    bias_correction2 = 1 - beta2 ** step
    corrected = m / t(bias_correction1)
    rho_inf = 2 / (1 - beta2) - 1
    rho_t = rho_inf - 2 * step * (beta2 ** step) / bias_correction2
    if rho_t > 5.0:
        rect = ((rho_t - 4) * (rho_t - 2) * rho_inf
                / ((rho_inf - 4) * (rho_inf - 2) * rho_t)) ** 0.5
        # float / tensor is tensor.reciprocal() * float in torch
        adaptive_lr = (t(1) / (np.sqrt(v) + t(hp["eps"]))) * t(bias_correction2 ** 0.5)
        return p - corrected * t(lr) * adaptive_lr * t(rect)
    return p - corrected * t(lr)


def adadelta(state, p, g, hp):
    t = p.dtype.type
    rho, eps = hp["rho"], hp["eps"]
    if not state:
        state.update(step=0, square_avg=np.zeros_like(p), acc_delta=np.zeros_like(p))
    state["step"] += 1
    g = -g if hp["maximize"] else g.copy()
    if hp["weight_decay"] != 0:
        g = g + t(hp["weight_decay"]) * p
    v = state["square_avg"] = state["square_avg"] * t(rho) + t(1 - rho) * g * g
    std = np.sqrt(v + t(eps))
    delta = np.sqrt(state["acc_delta"] + t(eps)) / std * g
    state["acc_delta"] = state["acc_delta"] * t(rho) + t(1 - rho) * delta * delta
    return p + t(-hp["lr"]) * delta


def rmsprop(state, p, g, hp):
    t = p.dtype.type
    alpha = hp["alpha"]
    if not state:
        state.update(step=0, square_avg=np.zeros_like(p))
    if hp["momentum"] > 0:
        state.setdefault("momentum_buffer", np.zeros_like(p))
    if hp["centered"]:
        state.setdefault("grad_avg", np.zeros_like(p))
    g = -g if hp["maximize"] else g.copy()
    state["step"] += 1
    if hp["weight_decay"] != 0:
        g = g + t(hp["weight_decay"]) * p
    v = state["square_avg"] = state["square_avg"] * t(alpha) + t(1 - alpha) * g * g
    if hp["centered"]:
        a = state["grad_avg"] = _lerp(state["grad_avg"], g, t(1 - alpha))
        avg = np.sqrt(v - a * a)
    else:
        avg = np.sqrt(v)
    avg = avg + t(hp["eps"])
    if hp["momentum"] > 0:
        buf = state["momentum_buffer"] = state["momentum_buffer"] * t(hp["momentum"]) + g / avg
        return p + t(-hp["lr"]) * buf
    return p + (t(-hp["lr"]) * g) / avg


def rprop(state, p, g, hp):
    t = p.dtype.type
    etaminus, etaplus = hp["etas"]
    low, high = hp["step_sizes"]
    if not state:  # created at the parameter's first step, with the group's lr then
        state.update(step=0, prev=np.zeros_like(p), step_size=np.full_like(p, t(hp["lr"])))
    g = -g if hp["maximize"] else g.copy()
    state["step"] += 1
    sign = _torch_sign(g * state["prev"])
    factor = np.where(sign > 0, t(etaplus), np.where(sign < 0, t(etaminus), t(1)))
    step_size = state["step_size"] = np.minimum(np.maximum(state["step_size"] * factor, t(low)),
                                                t(high))
    g = np.where(sign < 0, t(0), g)  # where the sign flipped: no step, and prev = 0
    state["prev"] = g
    return p - _torch_sign(g) * step_size


def lion(state, p, g, hp):
    """Chen et al. 2023, Algorithm 2 (decoupled weight decay)."""
    t = p.dtype.type
    beta1, beta2 = hp["betas"]
    lr, wd = hp["lr"], hp["weight_decay"]
    if not state:
        state.update(step=0, exp_avg=np.zeros_like(p))
    g = -g if hp["maximize"] else g.copy()
    state["step"] += 1
    m = state["exp_avg"]
    c = t(beta1) * m + t(1 - beta1) * g
    if wd != 0:
        p = p * t(1 - lr * wd)
    update = _torch_sign(c)
    if hp["caution"]:  # timm's Lion: the mask of sign(c) * g, applied to sign(c)
        update = update * _caution_mask(update, g)
    p = p - t(lr) * update
    state["exp_avg"] = t(beta2) * m + t(1 - beta2) * g
    return p


def nadam(state, p, g, hp):
    t = p.dtype.type
    beta1, beta2 = hp["betas"]
    lr, wd, momentum_decay = hp["lr"], hp["weight_decay"], hp["momentum_decay"]
    if not state:
        state.update(step=0, mu_product=1.0, exp_avg=np.zeros_like(p),
                     exp_avg_sq=np.zeros_like(p))
    g = -g if hp["maximize"] else g.copy()
    state["step"] += 1
    step = float(state["step"])
    bias_correction2 = 1 - beta2 ** step
    if wd != 0:
        if hp["decoupled_weight_decay"]:
            p = p * t(1 - lr * wd)
        else:
            g = g + t(wd) * p
    mu = beta1 * (1.0 - 0.5 * (0.96 ** (step * momentum_decay)))
    mu_next = beta1 * (1.0 - 0.5 * (0.96 ** ((step + 1) * momentum_decay)))
    state["mu_product"] *= mu  # a Python float (torch: a 0-d tensor of its default dtype)
    mu_product = state["mu_product"]
    m = state["exp_avg"] = _lerp(state["exp_avg"], g, t(1 - beta1))
    v = state["exp_avg_sq"] = state["exp_avg_sq"] * t(beta2) + t(1 - beta2) * g * g
    denom = np.sqrt(v / t(bias_correction2)) + t(hp["eps"])
    p = p + (t(-lr * (1.0 - mu) / (1.0 - mu_product)) * g) / denom
    return p + (t((-lr * mu_next) / (1.0 - mu_product * mu_next)) * m) / denom


def asgd(state, p, g, hp):
    t = p.dtype.type
    lr, lambd = hp["lr"], hp["lambd"]
    if not state:  # created at the parameter's first step: eta = the group's lr then
        state.update(step=0, eta=lr, mu=1.0, ax=np.zeros_like(p))
    g = -g if hp["maximize"] else g.copy()
    state["step"] += 1
    if hp["weight_decay"] != 0:
        g = g + t(hp["weight_decay"]) * p
    eta = state["eta"]
    p = p * t(1 - lambd * eta)
    p = p + t(-eta) * g
    if state["mu"] != 1:
        state["ax"] = state["ax"] + (p - state["ax"]) * t(state["mu"])
    else:
        state["ax"] = np.copy(p)
    step = float(state["step"])  # eta and mu for the next step, from the new count
    state["eta"] = lr / ((1 + lambd * lr * step) ** hp["alpha"])
    state["mu"] = 1 / max(1, step - hp["t0"])
    return p


def adagrad_initial(p, hp):
    return {"step": 0, "sum": np.full_like(p, hp["initial_accumulator_value"])}


def adagrad(state, p, g, hp):
    t = p.dtype.type
    state["step"] += 1
    g = -g if hp["maximize"] else g.copy()
    if hp["weight_decay"] != 0:
        g = g + t(hp["weight_decay"]) * p
    clr = hp["lr"] / (1 + (float(state["step"]) - 1) * hp["lr_decay"])
    s = state["sum"] = state["sum"] + g * g
    return p + (t(-clr) * g) / (np.sqrt(s) + t(hp["eps"]))


def lamb(state, p, g, hp):
    """You et al. 2020, Algorithm 2, as apex's FusedLAMB: Adam's direction plus decoupled
    weight decay, scaled per tensor by ||p|| / ||direction|| (norms in float64)."""
    t = p.dtype.type
    beta1, beta2 = hp["betas"]
    if not state:
        state.update(step=0, exp_avg=np.zeros_like(p), exp_avg_sq=np.zeros_like(p))
    g = -g if hp["maximize"] else g.copy()
    state["step"] += 1
    m = state["exp_avg"] = t(beta1) * state["exp_avg"] + t(1 - beta1) * g
    v = state["exp_avg_sq"] = t(beta2) * state["exp_avg_sq"] + (t(1 - beta2) * g) * g
    if hp["bias_correction"]:
        m_hat = m / t(1 - beta1 ** state["step"])
        v_hat = v / t(1 - beta2 ** state["step"])
    else:
        m_hat, v_hat = m, v
    direction = m_hat / (np.sqrt(v_hat) + t(hp["eps"])) + t(hp["weight_decay"]) * p
    ratio = 1.0
    if hp["weight_decay"] != 0 or hp["always_adapt"]:
        p_norm = np.sqrt(np.sum(p.astype(np.float64) ** 2))
        d_norm = np.sqrt(np.sum(direction.astype(np.float64) ** 2))
        if p_norm > 0 and d_norm > 0:
            ratio = p_norm / d_norm
    return p + t(-(hp["lr"] * ratio)) * direction


def _orthogonalise(u, hp):
    """Newton-Schulz (torch.optim._muon._zeropower_via_newtonschulz) in u's dtype."""
    t = u.dtype.type
    a, b, c = (t(x) for x in hp["ns_coefficients"])
    tall = u.shape[0] > u.shape[1]
    x = u.T if tall else u
    x = x / max(t(np.sqrt(np.sum(x * x))), t(hp["eps"]))
    for _ in range(hp["ns_steps"]):
        gram = x @ x.T
        x = a * x + (b * gram + c * (gram @ gram)) @ x
    return x.T if tall else x


def muon(state, p, g, hp):
    """torch.optim.Muon's ``_single_tensor_muon`` (Newton-Schulz in the parameter's dtype,
    where torch uses bfloat16)."""
    t = p.dtype.type
    momentum = hp["momentum"]
    if not state:
        state["momentum_buffer"] = np.zeros_like(p)
    if p.size == 0:
        return p
    buf = state["momentum_buffer"] = _lerp(state["momentum_buffer"], g, t(1 - momentum))
    update = _lerp(g, buf, t(momentum)) if hp["nesterov"] else buf
    rows, cols = p.shape
    if hp["adjust_lr_fn"] == "match_rms_adamw":
        adjusted = hp["lr"] * 0.2 * np.sqrt(max(rows, cols))
    else:
        adjusted = hp["lr"] * np.sqrt(max(1, rows / cols))
    p = p * t(1 - hp["lr"] * hp["weight_decay"])
    return p + t(-adjusted) * _orthogonalise(update, hp)


def adafactor(state, p, g, hp):
    """torch.optim.Adafactor's ``_single_tensor_adafactor``, with NumPy's reductions."""
    t = p.dtype.type
    if not state:
        state["step"] = 0
        if p.ndim >= 2:
            state["row_var"] = np.zeros((*p.shape[:-1], 1), p.dtype)
            state["col_var"] = np.zeros((*p.shape[:-2], 1, p.shape[-1]), p.dtype)
        else:
            state["variance"] = np.zeros_like(p)
    state["step"] += 1
    if p.size == 0:
        return p  # torch divides by zero here; flatopt leaves the parameter alone
    g = -g if hp["maximize"] else g
    step = float(state["step"])
    eps1, eps2 = hp["eps"]
    eps1 = float(np.finfo(p.dtype).eps) if eps1 is None else eps1
    weight = step ** hp["beta2_decay"]
    rho = min(hp["lr"], 1 / np.sqrt(step))
    alpha = max(eps2, float(np.sqrt(np.sum(p.astype(np.float64) ** 2))) / np.sqrt(p.size)) * rho
    if hp["weight_decay"] != 0:
        p = p * t(1 - hp["lr"] * hp["weight_decay"])
    if p.ndim >= 2:
        row = state["row_var"] = _lerp(state["row_var"], np.mean(g * g, axis=-1, keepdims=True),
                                       t(weight))
        col = state["col_var"] = _lerp(state["col_var"], np.mean(g * g, axis=-2, keepdims=True),
                                       t(weight))
        var = (row @ col) / np.maximum(np.mean(row, axis=-2, keepdims=True), t(eps1))
    else:
        var = state["variance"] = _lerp(state["variance"], g * g, t(weight))
    update = g / np.sqrt(np.maximum(var, t(eps1 * eps1)))
    rms = float(np.sqrt(np.sum(update.astype(np.float64) ** 2))) / np.sqrt(p.size)
    return p + t(-alpha / max(1.0, rms / hp["d"])) * update


def adopt(state, p, g, hp):
    """timm's single-tensor Adopt."""
    t = p.dtype.type
    beta1, beta2 = hp["betas"]
    lr, wd = hp["lr"], hp["weight_decay"]
    if not state:
        state.update(step=0, exp_avg=np.zeros_like(p), exp_avg_sq=np.zeros_like(p))
    g = -g if hp["maximize"] else g.copy()
    state["step"] += 1
    if wd != 0 and not hp["decoupled"]:
        g = g + t(wd) * p
    if state["step"] == 1:
        state["exp_avg_sq"] = state["exp_avg_sq"] + g * g
        return p
    if wd != 0 and hp["decoupled"]:
        p = p + t(-lr * wd) * p
    normed = g / np.maximum(np.sqrt(state["exp_avg_sq"]), t(hp["eps"]))
    if hp["clip_exp"] is not None:
        bound = t(float(state["step"] - 1) ** hp["clip_exp"])
        normed = np.clip(normed, -bound, bound)
    m = state["exp_avg"] = _lerp(state["exp_avg"], normed, t(1 - beta1))
    if hp["caution"]:
        m = m * _caution_mask(m, g)
    state["exp_avg_sq"] = state["exp_avg_sq"] * t(beta2) + t(1 - beta2) * g * g
    return p + t(-lr) * m


def _schedulefree_group(hp):
    """The schedule-free group's numbers for this step (``hp["_step"]``), and its counters
    advanced, as the reference's ``step`` forms them in Python."""
    k = hp["k"]
    if "silent_sgd_phase" in hp:  # RAdam: the rectification is the warm-up
        beta2 = hp["betas"][1]
        t = k + 1
        beta2_t = beta2 ** t
        bias_correction2 = 1 - beta2_t
        rho_inf = 2 / (1 - beta2) - 1
        rho_t = rho_inf - 2 * t * beta2_t / bias_correction2
        normalize = rho_t > 4.0
        rect = ((rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t)
                ) ** 0.5 if normalize else float(not hp["silent_sgd_phase"])
        lr = hp["lr"] * rect
    else:
        lr = hp["lr"] * ((k + 1) / hp["warmup_steps"] if k < hp["warmup_steps"] else 1.0)
        normalize = "betas" in hp
        bias_correction2 = 1 - hp["betas"][1] ** (k + 1) if normalize else 1.0
    hp["lr_max"] = max(lr, hp["lr_max"])
    weight = ((k + 1) ** hp["r"]) * (hp["lr_max"] ** hp["weight_lr_power"])
    hp["weight_sum"] = hp["weight_sum"] + weight
    ckp1 = weight / hp["weight_sum"] if hp["weight_sum"] else 0.0
    hp["scheduled_lr"] = lr
    hp["k"] = k + 1
    beta1 = hp["betas"][0] if "betas" in hp else hp["momentum"]
    hp["_step"] = (lr, ckp1, lr * (beta1 * (1 - ckp1) - 1), normalize, bias_correction2)


def schedulefree(state, p, g, hp):
    """facebookresearch's schedulefree, single-tensor path (SGD, AdamW, RAdam)."""
    t = p.dtype.type
    lr, ckp1, y_lr, normalize, bias_correction2 = hp["_step"]
    if not state:
        state["z"] = p.copy()
        if "betas" in hp:
            state["exp_avg_sq"] = np.zeros_like(p)
    g = g.copy()
    if "betas" in hp:
        beta2 = hp["betas"][1]
        v = state["exp_avg_sq"] = state["exp_avg_sq"] * t(beta2) + t(1 - beta2) * g * g
        if normalize:
            g = g / (np.sqrt(v / t(bias_correction2)) + t(hp["eps"]))
    if hp["weight_decay"] != 0:
        g = g + t(hp["weight_decay"]) * p
    p = _lerp(p, state["z"], t(ckp1)) + t(y_lr) * g
    state["z"] = state["z"] + t(-lr) * g
    return p


def prodigy_step(ref, grads):
    """prodigyopt's Prodigy.step, over every group: two passes around the d estimate. A
    group's lr that is neither the largest nor 0 (which prodigyopt refuses) scales that
    group's dlr, as flatopt documents."""
    first = ref.groups[0][1]
    beta1, beta2 = first["betas"]
    beta3 = first["beta3"] if first["beta3"] is not None else float(np.sqrt(beta2))
    k, d, d_max = first["k"], first["d"], first["d_max"]
    lr = max(hp["lr"] for _, hp in ref.groups)
    bc = (((1 - beta2 ** (k + 1)) ** 0.5) / (1 - beta1 ** (k + 1))
          if first["use_bias_correction"] else 1)
    dlr = d * lr * bc

    def group_dlr(hp):
        return d * hp["lr"] * bc if hp["lr"] > 0 else dlr

    numerator, denominator = 0.0, 0.0
    stepped = {}
    for params, hp in ref.groups:
        wd = hp["weight_decay"]
        for path, p in params.items():
            g = grads.get(path)
            if g is None:
                continue
            t = p.dtype.type
            if wd != 0 and not first["decouple"]:
                g = g + t(wd) * p
            stepped[path] = g
            state = ref.state.setdefault(path, {})
            if not state:
                state.update(step=0, exp_avg=np.zeros_like(p), exp_avg_sq=np.zeros_like(p),
                             s=np.zeros_like(p), p0=p.copy())
            if hp["lr"] > 0:
                scale = d / hp["d0"]
                numerator += scale * group_dlr(hp) * float(np.dot(
                    g.astype(np.float64).ravel(), (state["p0"] - p).astype(np.float64).ravel()))
                if beta1 > 0:
                    state["exp_avg"] = state["exp_avg"] * t(beta1) + t(d * (1 - beta1)) * g
                state["exp_avg_sq"] = (state["exp_avg_sq"] * t(beta2)
                                       + t(d * d * (1 - beta2)) * g * g)
                weight = scale * (d if hp["safeguard_warmup"] else group_dlr(hp))
                state["s"] = state["s"] * t(beta3) + t(weight) * g
                denominator += float(np.abs(state["s"]).astype(np.float64).sum())
    if denominator == 0:
        return
    d_numerator = first["d_numerator"] * beta3 + numerator
    d_hat = first["d_coef"] * d_numerator / denominator
    new_d = max(d, d_hat) if d == ref.groups[-1][1]["d0"] else d
    d_max = max(d_max, d_hat)
    new_d = min(d_max, new_d * first["growth_rate"])
    for params, hp in ref.groups:
        wd = hp["weight_decay"]
        for path, p in params.items():
            if path not in stepped:
                continue
            t = p.dtype.type
            state = ref.state[path]
            state["step"] += 1
            denom = np.sqrt(state["exp_avg_sq"]) + t(new_d * hp["eps"])
            if wd != 0 and first["decouple"]:
                p = p + t(-wd * group_dlr(hp)) * p
            if beta1 > 0:
                p = p + t(-group_dlr(hp)) * state["exp_avg"] / denom
            else:
                p = p + t(-group_dlr(hp) * new_d) * stepped[path] / denom
            params[path] = p
    for _, hp in ref.groups:
        hp.update(d=new_d, d_max=d_max, d_numerator=d_numerator, k=hp["k"] + 1)


def ademamix_step(ref, grads):
    """bitsandbytes' _ReferenceAdEMAMix.step: every group's step count advances, gradient or
    not; alpha and beta3 scheduled once per parameter (see flatopt.AdEMAMix)."""
    import math
    for params, hp in ref.groups:
        hp["step"] = hp.get("step", 0) + 1
        step = hp["step"]
        beta1, beta2, beta3 = hp["betas"]
        alpha = hp["alpha"]
        if hp["t_alpha"] is not None:
            alpha = min(step * alpha / hp["t_alpha"], alpha)
        if hp["t_beta3"] is not None:
            ln1, ln3 = math.log(beta1), math.log(beta3)
            scale = step / hp["t_beta3"]
            beta3 = min(math.exp((ln1 * ln3) / (((1 - scale) * ln3) + (scale * ln1))), beta3)
        for path, p in params.items():
            g = grads.get(path)
            if g is None:
                continue
            t = p.dtype.type
            state = ref.state.setdefault(path, {})
            if not state:
                state.update(m1=np.zeros_like(p), m2=np.zeros_like(p), nu=np.zeros_like(p))
            m1 = state["m1"] = state["m1"] * t(beta1) + t(1 - beta1) * g
            m2 = state["m2"] = state["m2"] * t(beta3) + t(1 - beta3) * g
            nu = state["nu"] = state["nu"] * t(beta2) + t(1 - beta2) * g * g
            denom = np.sqrt(nu) / t((1 - beta2 ** step) ** 0.5) + t(hp["eps"])
            update = (m1 / t(1 - beta1 ** step) + t(alpha) * m2) / denom
            update = update + t(hp["weight_decay"]) * p
            params[path] = p + t(-hp["lr"]) * update


STEPS = {"Prodigy": prodigy_step, "AdEMAMix": ademamix_step}
"""Registry name -> ``(reference optimizer, grads)``: a step made over every group at once
(a global d estimate; group step counts)."""

RULES = {"SGD": sgd, "Adam": adam, "AdamW": adamw, "Adamax": adamax, "RAdam": radam,
         "Adadelta": adadelta, "RMSprop": rmsprop, "Rprop": rprop, "Lion": lion,
         "NAdam": nadam, "ASGD": asgd, "Adagrad": adagrad, "LAMB": lamb, "Muon": muon,
         "Adafactor": adafactor, "ADOPT": adopt, "ScheduleFreeSGD": schedulefree,
         "ScheduleFreeAdamW": schedulefree, "ScheduleFreeRAdam": schedulefree}
"""Registry name -> reference rule ``(state, p, g, hyperparameters) -> new p``; ``state`` is
the parameter's dict, filled by the rule (empty until the parameter has state)."""

GROUP_STEP = {name: _schedulefree_group
              for name in ("ScheduleFreeSGD", "ScheduleFreeAdamW", "ScheduleFreeRAdam")}
"""Registry name -> ``(hyperparameters) -> None``, run once per group at every step before
its parameters (whichever have gradients): optimizers with per-group counters keep them in
the group's hyperparameters, as their reference does."""

INITIAL_STATE = {"Adagrad": adagrad_initial}
"""Registry name -> ``(p, hyperparameters) -> state`` for optimizers whose state exists from
construction (eager schemas): every parameter starts with it, gradient or not."""
