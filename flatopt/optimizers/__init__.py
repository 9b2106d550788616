"""The optimizers, one module each (schema + class), registered in ``flatopt.registry``."""

from .adafactor import Adafactor, AdafactorParamState
from .adadelta import Adadelta, AdadeltaParamState
from .adagrad import Adagrad, AdagradParamState
from .adam import Adam, AdamParamState, AdamW
from .ademamix import AdEMAMix, AdEMAMixParamState
from .adamax import Adamax, AdamaxParamState
from .adopt import ADOPT, ADOPTParamState
from .asgd import ASGD, ASGDParamState
from .lamb import LAMB, LAMBParamState
from .lion import Lion, LionParamState
from .muon import Muon, MuonParamState
from .nadam import NAdam, NAdamParamState
from .prodigy import Prodigy, ProdigyParamState
from .radam import RAdam, RAdamParamState
from .rmsprop import RMSprop, RMSpropParamState
from .rprop import Rprop, RpropParamState
from .schedulefree import (ScheduleFreeAdamW, ScheduleFreeAdamWParamState, ScheduleFreeRAdam,
                           ScheduleFreeRAdamParamState, ScheduleFreeSGD,
                           ScheduleFreeSGDParamState)
from .sgd import SGD, SGDParamState

__all__ = ["SGD", "SGDParamState", "Adam", "AdamW", "AdamParamState",
           "Adamax", "AdamaxParamState", "RAdam", "RAdamParamState",
           "Adadelta", "AdadeltaParamState", "RMSprop", "RMSpropParamState",
           "Rprop", "RpropParamState", "Lion", "LionParamState",
           "NAdam", "NAdamParamState", "ASGD", "ASGDParamState",
           "Adagrad", "AdagradParamState", "LAMB", "LAMBParamState", "Muon", "MuonParamState",
           "Adafactor", "AdafactorParamState", "ADOPT", "ADOPTParamState",
           "ScheduleFreeSGD", "ScheduleFreeSGDParamState", "ScheduleFreeAdamW",
           "ScheduleFreeAdamWParamState", "ScheduleFreeRAdam", "ScheduleFreeRAdamParamState",
           "Prodigy", "ProdigyParamState", "AdEMAMix", "AdEMAMixParamState"]
