"""Step graphs: a decode step's ops recorded once per batch size and replayed from C++, without the Python around them.

A decode step of a small model on CPU spends about as long in Python (module calls, argument checks, the layers'
glue) as in its kernels. For a given number of decode sequences the step calls the same ops with the same shapes
every time; only the contents of a few input tensors change (token ids, positions, and what the attention
backend's metadata says: slots, block tables, context lengths). So the first such step runs eagerly under a
TorchDispatchMode that records every op with its arguments, and later steps hand the new input tensors to a C++
interpreter (csrc/step_graph.cpp) that calls the recorded ops through the dispatcher: the idea of a CUDA graph,
with dispatcher calls instead of kernel launches. Weights, KV caches and every Python scalar are fixed at
recording, so a step is only recorded where that is sound:

- every op returns tensors (none returns a Python scalar that could steer control flow, e.g. `.item()`);
- every tensor an op reads is an input, an earlier op's output, or a view of one of the `constants` the caller
  names (the model's parameters and buffers, the KV caches): a temporary made outside the ops would be frozen,
  so it refuses the step instead;
- the first replay of each graph is checked against the eager forward on the same inputs (a decode step's KV
  writes are idempotent), bitwise; a mismatch sends that batch size back to eager steps (logged).

Where the extension cannot be built, or with LLMRT_STEP_GRAPHS=0, every step runs eagerly.
"""
from __future__ import annotations

import functools
import logging
import os
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from llmrt.kernels.build import import_module, load_or_compile

logger = logging.getLogger(__name__)
SOURCE = Path(__file__).parent / "csrc" / "step_graph.cpp"


class NotReplayable(Exception):
    """A recorded step that a replay could not reproduce (the reason says which op or tensor)."""


@functools.lru_cache(maxsize=None)
def extension() -> Optional[Any]:
    """The compiled interpreter module, or None (the reason logged once) when off or unbuildable."""
    if os.environ.get("LLMRT_STEP_GRAPHS", "1").lower() in ("0", "off"):
        logger.info("step graphs off (LLMRT_STEP_GRAPHS=0): every step runs eagerly")
        return None
    try:
        b = load_or_compile("step_graph", "llmrt_step_graph", [SOURCE], ["-O2"], python_module=True)
        module = import_module("llmrt_step_graph", b.path)
    except Exception as e:  # no compiler, no ninja, a build error: eager steps still work
        logger.warning("step graphs unavailable (%s: %s); every step runs eagerly", type(e).__name__,
                       (str(e).strip().splitlines() or [""])[-1])
        return None
    logger.info("step graph interpreter %s in %.2f s (%s)", "loaded from cache" if b.how == "cached"
                else "compiled", b.seconds, b.path)
    return module


class _Recorder(TorchDispatchMode):
    """Runs every op as usual and keeps (op, args, kwargs, result) in call order."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch wraps a mode's __torch_dispatch__ to disable dynamo, which imports torch._dynamo (1.2 s here) on
        # the first op recorded: the first decode step of every process. Nothing here runs under dynamo.
        return False

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[Any, tuple, dict, Any]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.calls.append((func, args, kwargs, out))
        return out


def _schema_args(func: Any, args: tuple, kwargs: dict) -> list[Any]:
    """The call's arguments in schema order, defaults filled in."""
    values = []
    for i, a in enumerate(func._schema.arguments):
        if i < len(args) and not a.kwarg_only:
            values.append(args[i])
        elif a.name in kwargs:
            values.append(kwargs[a.name])
        elif a.has_default_value():
            values.append(a.default_value)
        else:
            raise NotReplayable(f"{func}: no value for argument {a.name}")
    return values


def _label(name: str, values: Sequence[Any]) -> str:
    """An op's name with its tensor arguments' shapes (schema order), e.g. 'aten::mm(1x768, 768x2304)'."""
    shapes = ["x".join(map(str, a.shape)) for a in values if isinstance(a, torch.Tensor)]
    return f"{name}({', '.join(shapes)})"


def _is_tensor_list(t: torch._C.Type) -> bool:
    return isinstance(t, torch._C.ListType) and t.getElementType().isSubtypeOf(torch._C.TensorType.get())


def _storage(t: torch.Tensor) -> int:
    """Where t's memory starts: parameters wrapped around a tensor, and views of it, share it. oneDNN's opaque
    weights (linear.prepack_dense_copy) have no storage to ask and no views: the tensor itself."""
    return id(t) if t.is_mkldnn else t.untyped_storage().data_ptr()


class StepGraph:
    """One recorded step, replayed by the C++ interpreter with new input tensors."""

    def __init__(self, ext: Any, calls: Sequence[tuple[Any, tuple, dict, Any]], inputs: Sequence[torch.Tensor],
                 outputs: Sequence[torch.Tensor], constants: set[int]):
        """`constants`: the storages (`_storage`) of the tensors the step may read besides inputs and outputs."""
        slot_of: dict[int, int] = {}
        count = 0

        def new_slot(t: torch.Tensor) -> int:
            nonlocal count
            slot_of[id(t)] = count
            count += 1
            return count - 1

        self.input_slots = [new_slot(t) for t in inputs]
        program = []
        self.op_labels: list[str] = []  # per op: its name and its tensor arguments' shapes (`timings`)
        for func, args, kwargs, out in calls:
            schema = func._schema
            for r in schema.returns:  # a Python scalar could steer the recorded forward's control flow
                if not (r.type.isSubtypeOf(torch._C.TensorType.get()) or _is_tensor_list(r.type)):
                    raise NotReplayable(f"{func} returns {r.type}, which the forward may have branched on")
            values = _schema_args(func, args, kwargs)
            self.op_labels.append(_label(schema.name, values))
            refs: list[tuple[int, int]] = []
            list_refs: list[tuple[int, int, int]] = []
            for i, v in enumerate(values):
                if isinstance(v, torch.Tensor):
                    if id(v) in slot_of:
                        refs.append((i, slot_of[id(v)]))
                        values[i] = None
                    elif _storage(v) not in constants:
                        raise NotReplayable(f"{func} reads a tensor {tuple(v.shape)} made outside the recorded ops")
                elif isinstance(v, (list, tuple)) and any(isinstance(e, torch.Tensor) for e in v):
                    if not _is_tensor_list(schema.arguments[i].type):
                        raise NotReplayable(f"{func}: argument {schema.arguments[i].name} is not a Tensor[]")
                    for j, e in enumerate(v):
                        if id(e) in slot_of:
                            list_refs.append((i, j, slot_of[id(e)]))
                        elif _storage(e) not in constants:
                            raise NotReplayable(f"{func} reads a tensor made outside the recorded ops")
            rets = [out] if len(schema.returns) == 1 else list(out) if schema.returns else []
            outs = [[new_slot(e) for e in r] if isinstance(r, (list, tuple)) else [new_slot(r)] for r in rets]
            program.append((schema.name, schema.overload_name, values, refs, list_refs, outs))
        missing = [t for t in outputs if id(t) not in slot_of]
        if missing:
            raise NotReplayable("an output is not made by a recorded op")
        self.output_slots = [slot_of[id(t)] for t in outputs]
        self._graph = ext.StepGraph(count)
        for name, overload, values, refs, list_refs, outs in program:
            self._graph.add(name, overload, values, refs, list_refs, outs)
        self.num_ops = len(program)

    def run(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The recorded step's outputs for these inputs (same shapes, dtypes and devices as the recorded ones)."""
        return self._graph.run(list(inputs), self.input_slots, self.output_slots)

    def set_timing(self, on: bool) -> None:
        """Time every op of later runs (wall clock around each call; on CUDA that is its launch only)."""
        self._graph.set_timing(on)

    def timings(self) -> tuple[list[tuple[str, float]], int]:
        """([(op label, total ms)] in program order, runs) since timing was turned on."""
        ns, runs = self._graph.timings()
        return [(label, t / 1e6) for label, t in zip(self.op_labels, ns)], runs


class StepGraphs:
    """The runner's step graphs, keyed by the step's shape (its number of decode sequences)."""

    def __init__(self, ext: Any, constants: Callable[[], Iterable[torch.Tensor]]):
        self._ext = ext
        self._constants = constants
        self._graphs: dict[Any, StepGraph] = {}
        self._checked: set[Any] = set()
        self._eager_only: set[Any] = set()
        self.enabled = True
        self.recorded = 0
        self.replayed = 0
        self.timing = False  # graphs time their ops (set_timing; LLMRT_STEP_GRAPH_TIMING=1 from the start)
        if os.environ.get("LLMRT_STEP_GRAPH_TIMING") == "1":
            self.set_timing(True)

    def set_timing(self, on: bool) -> None:
        """Time every op of every graph's later runs (and of graphs recorded later); turning it on resets the sums."""
        self.timing = on
        for graph in self._graphs.values():
            graph.set_timing(on)

    def timings(self) -> dict[Any, tuple[list[tuple[str, float]], int]]:
        """Per graph key: ([(op label, total ms)], runs) since timing was turned on."""
        return {key: graph.timings() for key, graph in self._graphs.items()}

    def clear(self) -> None:
        """Forget every graph (the KV caches or weights they read were replaced)."""
        self._graphs.clear()
        self._checked.clear()
        self._eager_only.clear()

    def run(self, key: Any, inputs: Sequence[torch.Tensor], eager: Callable[[], torch.Tensor]) -> torch.Tensor:
        """`eager()`'s result for this step: replayed when `key` has a graph, else computed eagerly (and recorded
        the first time `key` is seen). `inputs` are the tensors that differ between steps of the same `key`."""
        if not self.enabled or key in self._eager_only:
            return eager()
        graph = self._graphs.get(key)
        if graph is None:
            return self._record(key, inputs, eager)
        out = graph.run(inputs)[0]
        self.replayed += 1
        if key not in self._checked:
            ref = eager()
            self._checked.add(key)
            if not torch.equal(ref, out):
                logger.warning("the step graph for %s differs from the eager forward; that step runs eagerly", key)
                del self._graphs[key]
                self._eager_only.add(key)
                return ref
        return out

    def _record(self, key: Any, inputs: Sequence[torch.Tensor], eager: Callable[[], torch.Tensor]) -> torch.Tensor:
        with _Recorder() as rec:
            out = eager()
        try:
            constants = {_storage(t) for t in self._constants()}
            self._graphs[key] = graph = StepGraph(self._ext, rec.calls, inputs, [out], constants)
            self.recorded += 1
            if self.timing:
                graph.set_timing(True)
        except NotReplayable as e:
            logger.info("step %s runs eagerly: %s", key, e)
            self._eager_only.add(key)
        return out
