"""The drafter's compiled callables, and what compiling them cost, in one place.

Each OS process compiles its own copies (the launcher runs one process per GPU, so no two
threads ever share dynamo's or FX's process-global state). Shapes are static (a fixed
anchor count and sequence length), so a process compiles each callable once per distinct
input kind; `graphs()` must stay constant in steady-state training, and `report()` says where
the cold start went.
"""

from __future__ import annotations

import threading
import time

import torch
from torch._dynamo.utils import counters

_WRAPPING = threading.Lock()


class CompiledFunction:
    """torch.compile(fn, dynamic=False), counting the dynamo graphs its calls compile and the
    seconds those calls took (the forward's compile; a backward compiles lazily in autograd and
    is reported by dynamo's own timers, see `report`)."""

    def __init__(self, name: str, fn):
        self.name = name
        self._fn = fn
        self._compiled = None
        self.graphs = 0
        self.seconds = 0.0

    def _wrapper(self):
        if self._compiled is None:
            # Wrapped on first use: torch.compile imports inductor (docs/perf_notes.md, "Figures the code
            # quoted"), which a process that never compiles (a CPU target, a drafter without a static
            # shape) need not pay. The lock keeps it one wrapper when threads (the bench's thread
            # baseline) call it first together.
            with _WRAPPING:
                if self._compiled is None:
                    self._compiled = torch.compile(self._fn, dynamic=False)
        return self._compiled

    def __call__(self, *args, **kwargs):
        compiled = self._wrapper()
        before = counters["stats"]["unique_graphs"]
        start = time.perf_counter()
        out = compiled(*args, **kwargs)
        new_graphs = counters["stats"]["unique_graphs"] - before
        if new_graphs:
            self.graphs += new_graphs
            self.seconds += time.perf_counter() - start
        return out


_REGISTRY: dict[str, CompiledFunction] = {}


def compiled_function(name: str, fn) -> CompiledFunction:
    """The process's one compiled version of `fn`, registered under `name`."""
    if name in _REGISTRY:
        raise ValueError(f"a compiled callable named {name!r} exists already")
    _REGISTRY[name] = CompiledFunction(name, fn)
    return _REGISTRY[name]


def compile_count(name: str | None = None) -> int:
    """Dynamo graphs compiled by the drafter's callables in this process (all, or one name)."""
    if name is not None:
        return _REGISTRY[name].graphs
    return sum(fn.graphs for fn in _REGISTRY.values())


def report() -> dict:
    """Per callable: graphs and seconds of the calls that compiled them; dynamo's and inductor's
    own phase timers (seconds summed over the process), where the time inside a compile went (e.g.
    `async_compile.precompile`: Triton kernels; `compile_fx.<locals>.bw_compiler`); and what the
    process's caches answered (a warm start that still traces a joint graph missed the AOT cache)."""
    from torch._dynamo.utils import compilation_time_metrics
    phases = {name: round(sum(times), 3) for name, times in compilation_time_metrics.items() if times}
    caches = {f"{group}.{name}": count
              for group, prefix in (("aot_autograd", "autograd_cache_"), ("inductor", "fxgraph_cache_"))
              for name, count in counters[group].items() if name.startswith(prefix)}
    return {"graphs": {name: fn.graphs for name, fn in _REGISTRY.items()},
            "seconds": {name: round(fn.seconds, 3) for name, fn in _REGISTRY.items()},
            "phases": dict(sorted(phases.items(), key=lambda kv: -kv[1])), "caches": caches}
