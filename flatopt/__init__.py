"""flatopt: fast, exact, resumable optimizer steps for NumPy training code.

Parameters live in contiguous per-(group, dtype) buffers; fused Numba kernels update whole
buffers in one parallel call, following torch.optim's semantics exactly. Every optimizer is
declared by a schema and found through :mod:`flatopt.registry`.
"""

import importlib

from . import registry
from ._layout import FlatBuffer, ParamIndex, ParamInfo
from ._views import Gradients, ParamViews
from .errors import (CheckpointCorrupt, CheckpointError, CheckpointMismatch,
                     CheckpointOptionError, DeviceError, EnvironmentVariableError, FlatoptError,
                     GradientError, GroupAssignmentError, HyperparameterError, ModeError,
                     NonFiniteGradientWarning, ParamError, RuleDefinitionError, StateDictError,
                     StepLimitError,
                     UnknownGradientError, UnknownPathError)
from .grouping import group_by_pattern
from .optimizer import BufferState, Optimizer
from .optimizers import (ADOPT, ASGD, SGD, ADOPTParamState, Adadelta, AdadeltaParamState, Adafactor,
                         AdafactorParamState, Adagrad, AdagradParamState, Adam, Adamax,
                         AdamaxParamState, AdamParamState, AdamW, ASGDParamState, LAMB,
                         LAMBParamState, Lion, LionParamState, Muon, MuonParamState, NAdam,
                         NAdamParamState, RAdam, RAdamParamState, RMSprop, RMSpropParamState,
                         Rprop, RpropParamState, ScheduleFreeAdamW, ScheduleFreeAdamWParamState,
                         ScheduleFreeRAdam, ScheduleFreeRAdamParamState, ScheduleFreeSGD,
                         ScheduleFreeSGDParamState, SGDParamState, Prodigy, ProdigyParamState,
                         AdEMAMix, AdEMAMixParamState)
from .schema import Column, Hyperparameter, Schema, Slot
from ._stepping import StepResult
from .lookahead import Lookahead
from .training import EMA, GradScaler, clip_grad_norm, scale_gradients
from .kernels.threads import get_policy as get_parallel_policy
from .kernels.threads import set_policy as set_parallel_policy

from . import lr_scheduler  # noqa: E402 (it builds on the optimizer classes above)
from . import blocks, transforms  # noqa: E402 (user rules build on the optimizer class above)
from .custom import define_optimizer  # noqa: E402
from .transforms import chain  # noqa: E402

from ._version import __version__

CHECKPOINT_NAMES = ("save", "load", "read", "LoadResult", "CheckpointData", "Difference")
"""Taken from :mod:`flatopt.checkpoint` when first asked for: it imports h5py (about 0.1 s),
which a run that never saves does not need."""


def __getattr__(name: str):
    if name in CHECKPOINT_NAMES:
        value = getattr(importlib.import_module(".checkpoint", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'flatopt' has no attribute {name!r}")

__all__ = [
    "SGD", "Adam", "AdamW", "Adamax", "RAdam", "Adadelta", "RMSprop", "Rprop", "Lion",
    "NAdam", "ASGD", "Adagrad", "LAMB", "Muon", "Adafactor", "ADOPT",
    "ScheduleFreeSGD", "ScheduleFreeAdamW", "ScheduleFreeRAdam", "Prodigy", "AdEMAMix",
    "Optimizer",
    "group_by_pattern", "lr_scheduler", "define_optimizer", "chain", "transforms", "blocks",
    "StepResult", "clip_grad_norm", "scale_gradients", "GradScaler", "EMA", "Lookahead",
    "set_parallel_policy", "get_parallel_policy",
    "ParamIndex", "ParamInfo", "FlatBuffer", "ParamViews", "Gradients",
    "SGDParamState", "AdamParamState", "AdamaxParamState", "RAdamParamState",
    "AdadeltaParamState", "RMSpropParamState", "RpropParamState", "LionParamState",
    "NAdamParamState", "ASGDParamState", "AdagradParamState", "LAMBParamState",
    "MuonParamState", "AdafactorParamState", "ADOPTParamState",
    "ScheduleFreeSGDParamState", "ScheduleFreeAdamWParamState", "ScheduleFreeRAdamParamState",
    "ProdigyParamState", "AdEMAMixParamState",
    "Schema", "Hyperparameter", "Column", "Slot", "BufferState", "registry",
    "FlatoptError", "DeviceError", "ParamError", "HyperparameterError", "GroupAssignmentError",
    "GradientError", "ModeError", "StateDictError", "StepLimitError", "UnknownPathError",
    "UnknownGradientError", "EnvironmentVariableError", "NonFiniteGradientWarning",
    "RuleDefinitionError",
    "save", "load", "read", "LoadResult", "CheckpointData", "Difference",
    "CheckpointError", "CheckpointMismatch", "CheckpointCorrupt", "CheckpointOptionError",
    "__version__",
]
