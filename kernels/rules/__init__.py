"""One module per update rule: the element-wise body, its span and prepare functions, and the
layouts of its scalars, flags and per-parameter columns (see ``kernels.rule.Rule``).

The bodies follow ``torch.optim`` 2.x's single-tensor path in the order of operations. Every
scalar reaches a span already in the buffer's dtype and the bodies contain no numeric
literals, so a float32 buffer never promotes to float64 inside the element loop.
"""
