"""The optimizers, one module each (schema + class), registered in ``flatopt.registry``."""

from .adadelta import Adadelta, AdadeltaParamState
from .adam import Adam, AdamParamState, AdamW
from .adamax import Adamax, AdamaxParamState
from .lion import Lion, LionParamState
from .radam import RAdam, RAdamParamState
from .rmsprop import RMSprop, RMSpropParamState
from .rprop import Rprop, RpropParamState
from .sgd import SGD, SGDParamState

__all__ = ["SGD", "SGDParamState", "Adam", "AdamW", "AdamParamState",
           "Adamax", "AdamaxParamState", "RAdam", "RAdamParamState",
           "Adadelta", "AdadeltaParamState", "RMSprop", "RMSpropParamState",
           "Rprop", "RpropParamState", "Lion", "LionParamState"]
