"""The optimizers, one module each (schema + class), registered in ``flatopt.registry``."""

from .adam import Adam, AdamParamState, AdamW
from .sgd import SGD, SGDParamState

__all__ = ["SGD", "SGDParamState", "Adam", "AdamW", "AdamParamState"]
