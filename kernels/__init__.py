"""Stateless kernels behind flatopt's optimizers (installed as ``flatopt.kernels``).

``rules`` holds one element-wise rule body per algorithm; ``cpu`` compiles them into fused,
parallel Numba kernels over whole flat buffers; ``cuda`` compiles the same bodies for numba-cuda.
"""
