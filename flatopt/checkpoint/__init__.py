"""HDF5 checkpoints: verified before they load, atomic on disk, refusing hostile files.

``save(path, opt)`` writes the optimizer's flat buffers (parameters and every state slot of its
schema) as checksummed datasets, plus a readable index and each group's hyperparameters, into a
temporary file that is fsynced and renamed over ``path``; a digest of everything is the last
thing written. ``load(path, opt)`` checks the whole file (structure, sizes, digests, every
buffer's checksums and values) and compares it with the live optimizer by path before a single
byte of the optimizer changes.

Modules, one job each: ``format`` (names, versions, limits, digests), ``files`` (atomic
replace), ``writer`` (save), ``reader`` (opening, hostile-file guards, structure), ``validate``
(what the contents mean against the optimizer's schema), ``compare`` (differences and the
options that accept them), ``loader`` (load), ``offline`` (read), ``tools`` (inspect,
verify, diff), ``extras`` (EMA and GradScaler state), ``run`` (several optimizers in one
directory), ``api`` (the public save, load and read: one optimizer or several, decided once).
"""

from .api import load, read, save
from .compare import Difference
from .format import FORMAT, FORMAT_VERSION
from .loader import LoadResult, open_checkpoint
from .offline import CheckpointData
from .tools import diff_checkpoints, inspect_checkpoint, verify_checkpoint
from .writer import SaveHandle

__all__ = ["save", "load", "read", "LoadResult", "CheckpointData", "SaveHandle", "Difference",
           "open_checkpoint", "inspect_checkpoint", "verify_checkpoint", "diff_checkpoints",
           "FORMAT", "FORMAT_VERSION"]
