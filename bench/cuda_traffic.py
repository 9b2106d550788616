"""The global loads and stores a CUDA kernel makes per element, counted in its PTX, against
the bytes the rule must move (``python -m bench.cuda_static`` prints them).

A kernel's PTX holds its element loop several times (unrolled, unswitched by the rule's
flags, one copy per storage format), so per-element counts are taken two ways:

- the rules' walks (plain and coded step, reduce): a *probe*, a kernel running the walk's own
  per-element functions (the rule's span or reduce over one element; for coded buffers
  ``kernels.cuda_coded.step_element`` and ``store_code``) with the flags, formats, mode and
  rounding a launch recorded passed as literal types, so that every branch on them folds
  and the element is straight-line code; the accesses counted are those whose address
  depends on the element's index (the scalars and per-parameter columns a walk reads once
  per segment are not);
- the tool kernels (gradient totals, scaling, accumulation, fill, EMA): their innermost
  loops, each access counted once per element (a loop's counts divided by its smallest,
  which is one per element for these branch-free loops).

A load or store beyond what the rule needs is a finding: the table says why each is there.
"""

from __future__ import annotations

import inspect
import re
import warnings

from numba import types, uint64

import flatopt
from bench import cuda_launches
from bench.cuda_static import compile_ptx, markdown_table
from flatopt.kernels import cuda_coded
from flatopt.kernels._bind import bind, instantiate
from flatopt.kernels._cuda_import import numba_cuda
from flatopt.kernels.coded import COMPENSATION_AT, KAHAN, MASTER, MASTER_AT
from flatopt.kernels.cuda_launch import KERNELS, recording, remake

WIDTH = {"8": 1, "16": 2, "32": 4, "64": 8}
ACCESS = re.compile(r"^(?:@!?%p\d+\s+)?((ld|st)\.global[.\w]*)\s+(.*);$")
REGISTER = re.compile(r"%[a-z]+\d+")
LITERAL_ARGUMENTS = ("flags", "formats", "rounding", "mode", "scale_grads")
"""Walk arguments a probe takes as literal types (the values the launch recorded)."""


# ----------------------------------------------------------------------------- PTX
def _body(ptx: str) -> list[str]:
    """The entry function's instructions and labels, one per line, comments dropped."""
    start = ptx.index(".entry")
    lines = []
    for line in ptx[ptx.index("{", start) + 1:].splitlines():
        line = line.split("//")[0].strip()
        if line and not line.startswith((".reg", ".loc", ".pragma", ".local", ".shared")):
            lines.append(line)
    return lines


def access_bytes(opcode: str) -> int:
    """Bytes one ``ld.global``/``st.global`` moves (``.v2``/``.v4`` vectors included)."""
    parts = opcode.split(".")
    width = next((WIDTH[p[1:]] for p in reversed(parts) if p[1:] in WIDTH and p[0] in "fubs"),
                 0)
    lanes = next((int(p[1:]) for p in parts if p in ("v2", "v4")), 1)
    return width * lanes


def _tainted(body: list[str], parameter: int) -> set[str]:
    """The registers whose values derive from kernel parameter ``parameter``."""
    tainted: set[str] = set()
    for _ in range(2):  # twice: a value carried round a loop
        for line in body:
            if line.endswith(":") or line.startswith("st."):
                continue
            if line.startswith("ld.param") and f"_param_{parameter}]" in line:
                tainted.add(REGISTER.findall(line)[0])
                continue
            operands = line.split(None, 1)[1] if " " in line else ""
            if operands.startswith("{"):  # a vector load: every register in braces
                destinations = REGISTER.findall(operands[:operands.index("}")])
            else:
                destinations = REGISTER.findall(operands)[:1] if "," in operands else []
            if set(REGISTER.findall(operands)[len(destinations):]) & tainted:
                tainted.update(destinations)
    return tainted


def element_accesses(ptx: str) -> dict[str, int]:
    """Loads and stores (by opcode) one element makes in a probe (no loops): those whose
    address derives from the kernel's last parameter (the element's index), along the path
    through the probe's branches that moves the most bytes (a rule's branches on its own
    data, or on scalars, may each hold a copy of a store: one of them runs)."""
    body = _body(ptx)
    last = max(int(n) for n in re.findall(r"_param_(\d+)\]", ptx))
    tainted = _tainted(body, last)
    blocks, successors = _blocks(body)
    own = []
    for block in blocks:
        counts: dict[str, int] = {}
        for line in block:
            access = ACCESS.match(line)
            if access and set(REGISTER.findall(
                    re.search(r"\[([^\]]+)\]", access.group(3)).group(1))) & tainted:
                counts[access.group(1)] = counts.get(access.group(1), 0) + 1
        own.append(counts)
    best: dict[int, dict] = {}
    for n in reversed(range(len(blocks))):  # PTX places a block before its successors
        after = [best[m] for m in successors[n] if m > n]
        tail = max(after, key=lambda c: sum(moved(c)), default={})
        best[n] = {op: own[n].get(op, 0) + tail.get(op, 0) for op in {*own[n], *tail}}
    return best[0] if blocks else {}


def _blocks(body: list[str]) -> tuple[list[list[str]], dict[int, list[int]]]:
    """Basic blocks of ``body`` and each one's successors."""
    blocks, labels = [[]], {}
    for line in body:
        if line.endswith(":"):
            if blocks[-1]:
                blocks.append([])
            labels[line[:-1]] = len(blocks) - 1
            continue
        blocks[-1].append(line)
        if re.match(r"(?:@!?%p\d+\s+)?(bra|ret|exit)", line):
            blocks.append([])
    successors = {}
    for n, block in enumerate(blocks):
        last = block[-1] if block else ""
        jump = re.match(r"(@!?%p\d+\s+)?bra(?:\.uni)?\s+(\S+);", last)
        out = []
        if jump:
            out.append(labels[jump.group(2)])
        if not (jump and not jump.group(1)) and not re.match(r"(ret|exit)", last) \
                and n + 1 < len(blocks):
            out.append(n + 1)
        successors[n] = out
    return blocks, successors


def loop_accesses(ptx: str) -> dict[str, float]:
    """Loads and stores per element of the kernel's innermost loops (the busiest one): each
    loop's counts divided by its smallest count."""
    blocks, successors = _blocks(_body(ptx))
    nodes = range(len(blocks))
    predecessors = {n: [m for m in nodes if n in successors[m]] for n in nodes}
    dominators = {n: set(nodes) for n in nodes}
    dominators[0] = {0}
    changed = True
    while changed:
        changed = False
        for n in nodes[1:]:
            incoming = [dominators[m] for m in predecessors[n]]
            new = {n} | (set.intersection(*incoming) if incoming else set())
            if new != dominators[n]:
                dominators[n], changed = new, True
    loops = []
    for tail in nodes:
        for head in successors[tail]:
            if head in dominators[tail]:  # a back edge: head's natural loop
                body, work = {head}, [tail]
                while work:
                    m = work.pop()
                    if m not in body:
                        body.add(m)
                        work.extend(predecessors[m])
                loops.append((head, body))
    best: dict[str, float] = {}
    best_rank = (False, 0.0)
    for head, body in loops:
        if any(other != head and other in body for other, _ in loops):
            continue  # not innermost
        counts: dict[str, int] = {}
        for n in body:
            for line in blocks[n]:
                access = ACCESS.match(line)
                if access:
                    counts[access.group(1)] = counts.get(access.group(1), 0) + 1
        if counts:
            least = min(counts.values())
            per_element = {op: count / least for op, count in counts.items()}
            # the element loop stores (a walk's loop over parameters only loads their
            # bookkeeping); else the one that loads the most
            rank = (any(op.startswith("st") for op in counts), sum(per_element.values()))
            if rank > best_rank:
                best, best_rank = per_element, rank
    return best


def moved(counts: dict) -> tuple[float, float]:
    """(bytes loaded, bytes stored) per element."""
    loads = sum(n * access_bytes(op) for op, n in counts.items() if op.startswith("ld"))
    stores = sum(n * access_bytes(op) for op, n in counts.items() if op.startswith("st"))
    return loads, stores


# ----------------------------------------------------------------------------- probes
def _span_probe(arrays, scalars, columns, k, i):
    span(arrays, scalars, columns, FLAGS, k, i, i + uint64(1), uint64(1))  # noqa: F821


def _reduce_probe(arrays, scalars, columns, sums, k, i):
    values = reduce(arrays, scalars, columns, FLAGS, k, i, i + uint64(1),  # noqa: F821
                    uint64(1))
    for j in range(len(values)):
        sums[k, j] = values[j]


def _coded_probe(stored, absmax, tables, seed, draw, scalars, columns, grad_multiplier, k,
                 largest, i):
    scratch = cuda.local.array((ROWS_MAX, 1), float32)  # noqa: F821
    step_element(stored, FORMATS, absmax, tables, ROUNDING, MODE, seed, draw,  # noqa: F821
                 scalars, columns, FLAGS, scratch, k, i, grad_multiplier, SCALE_GRADS)  # noqa: F821
    for j in range(2, len(FORMATS) - 2):  # noqa: F821
        if FORMATS[j] == Q8_SIGNED or FORMATS[j] == Q8_UNSIGNED:  # noqa: F821
            store_code(stored, FORMATS[j], j, i, scratch[j, 0], largest)  # noqa: F821


def _coded_reduce_probe(stored, absmax, tables, seed, draw, scalars, columns, sums,
                        grad_multiplier, k, i):
    scratch = cuda.local.array((ROWS_MAX, 1), float32)  # noqa: F821
    load_element(stored, FORMATS, absmax, tables, MODE, seed, draw, scratch, i,  # noqa: F821
                 SCALE_GRADS, grad_multiplier, len(FORMATS) - 2)  # noqa: F821
    values = reduce(as_rows(scratch), scalars, columns, FLAGS, k, 0, 1, 1)  # noqa: F821
    for j in range(len(values)):
        sums[k, j] = values[j]


PROBES = {"step": _span_probe, "step, float64": _span_probe, "state map": _span_probe,
          "reduce": _reduce_probe, "reduce, float64": _reduce_probe,
          "coded step": _coded_probe, "coded 8-bit block step": _coded_probe,
          "scaling (16-bit)": _coded_probe, "coded reduce": _coded_reduce_probe}
"""The probe of each walk family; every other family is counted in its own loops."""


def probe(found):
    """(the probe kernel's function, its argument types) for ``found``'s launch: the walk's
    arguments by name, the launch's flags, formats, mode, rounding and scaling bound as
    constants (folded), ``k`` and the element index ``i`` (last: the accesses counted are
    those it reaches)."""
    launch = found.launch
    walk = list(inspect.signature(remake(launch.kernel, launch.source).py_func).parameters)
    rule = launch.source.arguments[0]
    template = PROBES[found.family]
    if template in (_coded_probe, _coded_reduce_probe):
        bound = cuda_coded.coded_functions(rule)
    else:
        functions = bind(rule, cuda_coded.cuda.jit(device=True),
                         {"fma": cuda_coded.fma_primitive()})
        bound = {"span": functions[rule.span.__name__]}
        if rule.reduce is not None:
            bound["reduce"] = functions[rule.reduce.__name__]
    for name in LITERAL_ARGUMENTS:
        if name in walk:
            bound[name.upper()] = launch.values[walk.index(name)]
    own = {"k": types.int64, "i": types.uint64, "largest": types.float32}
    argument_types = tuple(own[name] if name in own else launch.types[walk.index(name)]
                           for name in inspect.signature(template).parameters)
    function = instantiate(template, f"probe_{launch.kernel}",
                           **{**vars(cuda_coded), **bound})
    return function, argument_types


def per_element(found, cc: tuple) -> dict[str, float]:
    """Loads and stores per element of ``found``'s kernel, by opcode, compiled for ``cc``
    (in a compile worker: no simulator, inside ``bench.cuda_static.target``)."""
    if found.family in PROBES:
        function, argument_types = probe(found)
        ptx, _ = numba_cuda().compile_ptx(function, argument_types, cc=cc)
        return element_accesses(ptx)
    return loop_accesses(compile_ptx(found, cc)[0])


# ----------------------------------------------------------------------------- the table
FORMAT_BYTES = {0: 0, 1: 4, 2: 2, 3: 2, 4: 1, 5: 1}
"""Bytes an element of each ``kernels.coded`` format takes (UNUSED, NATIVE, BF16, F16, Q8)."""


def traffic_jobs(names=None) -> list[tuple]:
    """(``Found``, ``Scenario``) of each kernel launch the traffic table counts: every
    registered optimizer's float32 step with its default settings (and the device's tool
    kernels it launches), and the representative with int8 state in float64 and in every
    storage layout. Runs in the simulator (launches recorded, none run)."""
    names = flatopt.registry.names() if names is None else names
    rules = {id(flatopt.registry.lookup(n).schema.rule) for n in flatopt.registry.names()}
    chosen = next(n for n in cuda_launches.representatives()
                  if flatopt.registry.lookup(n).schema.int8_state)
    scenarios = [cuda_launches.Scenario(n, "float32") for n in names]
    scenarios += [cuda_launches.Scenario(chosen, "float64")] + [
        cuda_launches.Scenario(chosen, dtype, storage) for dtype, storage in
        cuda_launches._storages(flatopt.registry.lookup(chosen).schema)]
    jobs, seen = [], set()
    for scenario in scenarios:
        with warnings.catch_warnings(), recording() as launched:
            warnings.simplefilter("ignore")
            cuda_launches.exercise(scenario)
        for launch in launched:
            family = cuda_launches.family(launch, rules)
            # a span's probe takes no scaling (the plain walk scales in a loop of its own,
            # counted in the "scaling" row): one row whether the step scaled or not
            values = launch.values[:-1] if PROBES.get(family) in (_span_probe, _reduce_probe) \
                else launch.values
            key = (launch.kernel, launch.types, values if family in PROBES else None)
            if family not in ("prepare", "finalize") and key not in seen:
                seen.add(key)
                jobs.append((cuda_launches.Found(launch, family, (scenario.label,)), scenario))
    return jobs


def needed(found, scenario) -> tuple[int, int] | None:
    """(bytes read, bytes written) per element a rule's step must move: its parameters (or
    master weights, or parameters and Kahan compensation), gradients read, each state slot
    its settings use read and written, in their stored formats; None for other kernels."""

    if found.family in ("step", "step, float64"):
        schema = flatopt.registry.lookup(scenario.optimizer).schema
        values = {key: h.default for key, h in schema.hyperparameters.items()}
        settings, _ = schema.check_group({**values, **dict(scenario.settings)}, "traffic")
        size = 8 if found.family.endswith("float64") else 4
        slots = len(schema.parallel_slots(settings))
        return size * (2 + slots), size * (1 + slots)
    if found.family not in ("coded step", "coded 8-bit block step"):
        return None
    launch = found.launch
    walk = list(inspect.signature(KERNELS[launch.kernel]).parameters)
    formats = launch.values[walk.index("formats")]
    mode = launch.values[walk.index("mode")]
    size = [FORMAT_BYTES[f] for f in formats]
    state = sum(size[2:MASTER_AT])
    extra = size[MASTER_AT] if mode == MASTER else size[COMPENSATION_AT] if mode == KAHAN else 0
    return (0 if mode == MASTER else size[0]) + size[1] + state + extra, size[0] + state + extra


def _describe(counts: dict, kind: str) -> str:
    parts = [f"{n:g} x {op.split('.')[-1]}" for op, n in sorted(counts.items())
             if op.startswith(kind)]
    return ", ".join(parts) or "-"


def rows(jobs: list, results: list[dict]) -> list[dict]:
    """The traffic table's rows: per launch, loads and stores per element and the bytes the
    rule must move."""
    table = []
    for (found, scenario), result in zip(jobs, results):
        counts = result["counts"]
        loads, stores = moved(counts)
        need = needed(found, scenario)
        extra = "" if need is None else ", ".join(
            f"+{have - want:g} B {what}" for have, want, what in
            ((loads, need[0], "loaded"), (stores, need[1], "stored")) if have > want)
        scaled = found.family in PROBES and found.launch.values[-1] is True  # scale_grads
        table.append({"scenario": scenario.label + (", gradients scaled" if scaled else ""),
                      "family": found.family,
                      "kernel": found.launch.kernel, "loads": _describe(counts, "ld"),
                      "stores": _describe(counts, "st"), "loaded": loads, "stored": stores,
                      "needed": need, "beyond": extra, "error": result["error"]})
    return table


def markdown(table: list[dict]) -> str:
    return markdown_table(
        ["configuration", "family", "loads / element", "stores / element",
         "bytes (loaded + stored)", "the rule needs", "beyond it"],
        [[row["scenario"], row["family"], row["loads"], row["stores"],
          f"{row['loaded']:g} + {row['stored']:g}",
          "-" if row["needed"] is None else f"{row['needed'][0]} + {row['needed'][1]}",
          row["error"] or row["beyond"] or "-"] for row in table])
