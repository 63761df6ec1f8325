"""Derive a receive plan from an engine model's own weight loader, without running it on data.

``trace_load_weights(model, wire_specs)`` calls the model's ``load_weights`` with the trainer's
tensors (the wire layout: HF names, unfused, full shapes) as tensors *without storage* (torch's
"meta" device, the wire dtype and shape) while a torch dispatch mode watches every operator:

* a view of a wire tensor (narrow, slice, select, view, transpose, permute, expand, ...) runs on
  the meta device and stays a view of it: its storage offset and strides say which elements of the
  wire tensor it covers;
* ``copy_`` of such a view into a view of one of the model's parameters is recorded as a
  :class:`shadowsync.receive_plan.PlanCopy` and *not executed*;
* anything else that touches a wire tensor (a dtype conversion, ``cat``, arithmetic, ``clone``,
  ``.item()``) or writes a parameter (``fill_``, ``zero_``, a copy from a real tensor) is refused
  before it runs: a receive plan can only copy.

Views of the real parameters run normally (they read nothing and write nothing), so the loader's
own shape checks (``param.data.shape == loaded_weight.shape``, ``.numel()``, ``.dim()``) keep
working. Nothing the loader holds is materialised: the wire tensors never get storage.

Every refusal raises :class:`shadowsync.errors.LayoutMismatchError` (the engine's layout cannot be
reached from the wire layout by copies) naming the parameter, the wire tensor and the operation;
malformed arguments (not a tensor spec, a name twice, no loader) raise ``InvalidArgumentError``.
A refusal leaves the model's parameters as they were.

Thread: trace on the thread that owns the model, while nothing else uses it (at set-up, before the
engine serves). torch is imported inside the function only: importing this module (or
``shadowsync.vllm``) imports neither torch nor vllm.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from shadowsync.errors import InvalidArgumentError, LayoutMismatchError
from shadowsync.layout import TensorSpec, canonical_dtype, format_shape
from shadowsync.receive_plan import PlanCopy

from .loader_dispatch import make_recording_mode

__all__ = ["STAND_IN_FLAG", "LoaderTrace", "trace_load_weights"]

# A meta parameter carrying this attribute (True) stands in for a parameter as the loader wrote
# it, which the engine replaced afterwards (online_fp8.as_loaded: vLLM's FP8 quantized while
# loading): the trace records copies into it like into any parameter.
STAND_IN_FLAG = "_shadowsync_as_loaded"

# Canonical dtype name (shadowsync) -> torch dtype attribute.
_TORCH_DTYPE = {
    "fp32": "float32",
    "fp16": "float16",
    "bf16": "bfloat16",
    "fp8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
    "int8": "int8",
    "uint8": "uint8",
    "int32": "int32",
    "int64": "int64",
}

_MAX_LISTED = 20  # names listed in one error before "... and N more"

_WHAT_TO_DO_COMPUTE = (
    "a receive plan can only copy views of the trainer's tensors into the engine's parameters; "
    "send the tensors in the dtype and form the engine keeps, or let the engine load this "
    "weight itself (no receive plan)")


@dataclass
class LoaderTrace:
    """What the loader would do with the wire tensors, as copies.

    ``copies``: in the order the loader made them. ``engine_params``: name -> parameter object for
    every parameter the copies write, in ``model.named_parameters()`` order; each is written
    exactly once, element for element. ``unwritten_params``: the model's parameters no copy writes
    (the caller decides whether a partial update is what it wants). ``identity``: every wire
    tensor lands whole in the parameter of its name and shape, each element at its own position
    (the loader may copy it in pieces, as for a tensor fused on disk), so the receive can stay
    zero-copy into the engine's own parameters."""

    copies: list[PlanCopy]
    engine_params: dict[str, Any]
    identity: bool
    unwritten_params: list[str] = field(default_factory=list)


def _listing(names: list[str]) -> str:
    shown = ", ".join(f"'{n}'" for n in names[:_MAX_LISTED])
    if len(names) > _MAX_LISTED:
        shown += f", ... and {len(names) - _MAX_LISTED} more"
    return shown


def _torch_dtype(torch, spec: TensorSpec):
    canonical = canonical_dtype(spec.dtype)[0]
    name = _TORCH_DTYPE.get(canonical)
    dtype = getattr(torch, name, None) if name else None
    if dtype is None:
        raise InvalidArgumentError(
            f"wire tensor '{spec.name}': dtype {spec.dtype} ({canonical}) has no torch dtype here")
    return dtype


def _span(shape, strides) -> int:
    """The largest element index a view of this shape and these strides reaches past its first."""
    return sum((n - 1) * s for n, s in zip(shape, strides) if n > 0)


def _same_positions(shape, src_strides, dst_strides) -> bool:
    """Whether both views address the same element positions (strides of size-1 dims aside)."""
    return all(n == 1 or s == d for n, s, d in zip(shape, src_strides, dst_strides))


class _Refused(Exception):
    """Internal: carries the first refusal through the loader (which may catch exceptions)."""


class _State:
    """What the dispatch mode knows while the loader runs. Everything it holds is metadata or an
    alias of a parameter: the wire tensors are meta tensors and never get storage."""

    def __init__(self, specs: list[TensorSpec], sources: list, params: list[tuple[str, Any]],
                 buffers: list[tuple[str, Any]]):
        self.specs = specs
        self.sources = sources  # kept alive: their storages identify the wire tensors
        # meta storage id -> wire index
        self.wire_of = {s.untyped_storage()._cdata: i for i, s in enumerate(sources)}
        # meta storage id -> (wire index, operator): results of computations on wire tensors
        self.computed: dict[int, tuple[int, str]] = {}
        self.computed_keep: list = []
        self.params = params
        # real storage address -> [(name, param)]; a stand-in (meta, no address): its storage id
        self.params_by_storage: dict[int, list[tuple[str, Any]]] = {}
        self.stand_ins_by_storage: dict[int, list[tuple[str, Any]]] = {}
        for name, p in params:
            if p.device.type == "meta":
                self.stand_ins_by_storage.setdefault(p.untyped_storage()._cdata, []).append(
                    (name, p))
            else:
                self.params_by_storage.setdefault(p.untyped_storage().data_ptr(), []).append(
                    (name, p))
        self.buffers_by_storage = {}
        for name, b in buffers:
            if b.device.type != "meta" and b.numel() > 0:
                self.buffers_by_storage.setdefault(b.untyped_storage().data_ptr(), name)
        self.copies: list[PlanCopy] = []
        self.current_wire: str | None = None  # the wire tensor the loader took last
        self.refusal: LayoutMismatchError | None = None

    # -- what a tensor is ------------------------------------------------------------------------

    def _storage_id(self, t) -> int | None:
        if t.device.type != "meta":
            return None
        try:
            return t.untyped_storage()._cdata
        except (RuntimeError, NotImplementedError):
            return None

    def wire_index(self, t) -> int | None:
        sid = self._storage_id(t)
        return None if sid is None else self.wire_of.get(sid)

    def computed_from(self, t) -> tuple[int, str] | None:
        sid = self._storage_id(t)
        return None if sid is None else self.computed.get(sid)

    def param_storage(self, t) -> list[tuple[str, Any]] | None:
        """The parameters sharing t's storage (None when t aliases no parameter)."""
        if t.device.type == "meta":
            sid = self._storage_id(t)
            return None if sid is None else self.stand_ins_by_storage.get(sid)
        try:
            ptr = t.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):
            return None
        return self.params_by_storage.get(ptr)

    def describe_target(self, t) -> str:
        """How an error names a tensor that is not a parameter."""
        if t.device.type != "meta":
            try:
                buffer = self.buffers_by_storage.get(t.untyped_storage().data_ptr())
            except (RuntimeError, NotImplementedError):
                buffer = None
            if buffer is not None:
                return f"buffer '{buffer}', not a parameter"
        return (f"a tensor of shape {format_shape(t.shape)} ({t.dtype}, {t.device}) that is no "
                f"parameter of the model (a temporary)")

    # -- refusals --------------------------------------------------------------------------------

    def refuse(self, message: str):
        if self.refusal is None:
            self.refusal = LayoutMismatchError(message)
        raise _Refused(message)

    def wire_name(self, index: int) -> str:
        return self.specs[index].name

    def refuse_compute(self, op: str, wire: int, param: str | None):
        target = f"for parameter '{param}'" if param else "(its result reaches no parameter)"
        if param is None and op in ("aten::_local_scalar_dense", "aten::is_nonzero",
                                    "aten::equal"):
            target = "(it reads an element's value, e.g. .item())"
        self.refuse(f"the loader computes ({op}) on '{self.wire_name(wire)}' {target}: "
                    f"{_WHAT_TO_DO_COMPUTE}")

    # -- copies ----------------------------------------------------------------------------------

    def locate(self, t, candidates, op: str, wire: str | None) -> tuple[str, Any, int]:
        """(name, param, offset of t's first element from the param's first one, in elements)."""
        by = f" from wire tensor '{wire}'" if wire else ""
        hits = []
        for name, p in candidates:
            if t.dtype != p.dtype:
                continue
            rel = t.storage_offset() - p.storage_offset()
            if rel >= 0 and rel + _span(t.shape, t.stride()) < p.numel():
                hits.append((name, p, rel))
        if len(hits) == 1:
            return hits[0]
        names = ", ".join(f"'{n}'" for n, _ in candidates)
        if not hits:
            name, p = candidates[0]
            if all(t.dtype != p.dtype for _, p in candidates):
                self.refuse(f"the loader writes parameter '{name}' ({p.dtype}) through a view of "
                            f"dtype {t.dtype} ({op}{by}): a receive plan copies elements of the "
                            f"parameter's own dtype; the engine must keep the trainer's tensors "
                            f"as they are")
            self.refuse(f"the loader writes a view (offset {t.storage_offset()}, shape "
                        f"{format_shape(t.shape)}, strides {format_shape(t.stride())}) of the "
                        f"storage of parameter(s) {names} that lies outside each of them ({op}"
                        f"{by}): a receive plan writes within one parameter")
        self.refuse(f"the loader writes a view that lies in several parameters sharing one "
                    f"storage ({names}) ({op}{by}): cannot tell which one it writes")
        raise AssertionError  # unreachable

    def record_copy(self, dst, src, wire: int, candidates):
        spec = self.specs[wire]
        op = "aten::copy_"
        name, param, rel = self.locate(dst, candidates, op, spec.name)
        if not param.is_contiguous():
            self.refuse(f"parameter '{name}' is not contiguous (shape {format_shape(param.shape)}, "
                        f"strides {format_shape(param.stride())}) while the loader copies "
                        f"'{spec.name}' into it: a receive plan addresses parameters as "
                        f"contiguous tensors")
        source = self.sources[wire]
        if src.dtype != source.dtype:
            self.refuse(f"the loader reinterprets wire tensor '{spec.name}' ({source.dtype}) as "
                        f"{src.dtype} (a view with another dtype) for parameter '{name}': "
                        f"{_WHAT_TO_DO_COMPUTE}")
        if dst.dtype != src.dtype:
            self.refuse(f"the loader copies wire tensor '{spec.name}' ({src.dtype}) into "
                        f"parameter '{name}' ({dst.dtype}) with aten::copy_, which converts the "
                        f"dtype: a receive plan can only copy; send '{spec.name}' as {dst.dtype} "
                        f"or make the engine keep {src.dtype}")
        shape = tuple(dst.shape)
        if tuple(src.shape) != shape:
            self.refuse(f"the loader copies a view of wire tensor '{spec.name}' of shape "
                        f"{format_shape(src.shape)} into a view of parameter '{name}' of shape "
                        f"{format_shape(shape)} (aten::copy_ broadcasts): a receive plan copies "
                        f"element for element")
        for n, s in zip(shape, src.stride()):
            if n > 1 and s == 0:
                self.refuse(f"the loader copies a broadcast (expanded, stride 0) view of wire "
                            f"tensor '{spec.name}' (shape {format_shape(shape)}, strides "
                            f"{format_shape(src.stride())}) into parameter '{name}' "
                            f"(aten::copy_): a receive plan copies element for element")
        for n, s in zip(shape, dst.stride()):
            if n > 1 and s == 0:
                self.refuse(f"the loader copies wire tensor '{spec.name}' into a view of "
                            f"parameter '{name}' that repeats elements (stride 0, strides "
                            f"{format_shape(dst.stride())}) (aten::copy_): each element of a "
                            f"parameter must be written once")
        numel = 1
        for n in shape:
            numel *= n
        if numel == 0:
            return
        src_offset = src.storage_offset()
        wire_numel = source.numel()
        if src_offset < 0 or src_offset + _span(shape, src.stride()) >= wire_numel:
            self.refuse(f"the loader copies a view of wire tensor '{spec.name}' (offset "
                        f"{src_offset}, shape {format_shape(shape)}, strides "
                        f"{format_shape(src.stride())}) that reaches past its {wire_numel} "
                        f"elements into parameter '{name}' (aten::copy_)")
        self.copies.append(PlanCopy(
            wire=spec.name, engine=name, shape=shape, src_offset=int(src_offset),
            src_strides=tuple(int(s) for s in src.stride()), dst_offset=int(rel),
            dst_strides=tuple(int(s) for s in dst.stride())))


def _runs(torch, shape, strides, offset: int):
    """(starts, lengths) of the contiguous element runs a view covers, as int64 tensors."""
    dims = [(int(n), int(s)) for n, s in zip(shape, strides) if n != 1]
    dims.sort(key=lambda d: d[1])  # innermost first
    merged: list[list[int]] = []
    for n, s in dims:
        if merged and s == merged[-1][0] * merged[-1][1]:
            merged[-1][0] *= n
        else:
            merged.append([n, s])
    length = 1
    if merged and merged[0][1] == 1:
        length = merged.pop(0)[0]
    starts = torch.tensor([offset], dtype=torch.int64)
    for n, s in merged:
        starts = (starts[:, None] + torch.arange(n, dtype=torch.int64)[None, :] * s).reshape(-1)
    return starts, torch.full_like(starts, length)


def _coverage(torch, numel: int, copies: list[PlanCopy]) -> tuple[int, int]:
    """(elements no copy writes, elements written more than once) of a parameter."""
    pieces = [_runs(torch, c.shape, c.dst_strides, c.dst_offset) for c in copies]
    starts = torch.cat([p[0] for p in pieces])
    lengths = torch.cat([p[1] for p in pieces])
    order = torch.argsort(starts)
    starts, lengths = starts[order], lengths[order]
    ends = starts + lengths
    reach = torch.cummax(ends, dim=0).values
    previous = torch.cat([torch.tensor([0], dtype=torch.int64), reach[:-1]])
    union = int(torch.clamp(ends - torch.maximum(starts, previous), min=0).sum())
    total = int(lengths.sum())
    return numel - union, total - union


def trace_load_weights(model, wire_specs: Iterable, load_weights: Callable | None = None
                       ) -> LoaderTrace:
    """Run ``model.load_weights`` (or ``load_weights``) on storage-less stand-ins of the wire
    tensors and return the copies it makes into the model's parameters.

    ``wire_specs``: the trainer's tensors, ``TensorSpec`` or (name, dtype, shape[, group]) tuples,
    in the order the trainer sends them; the loader receives them in that order as
    ``(name, tensor)`` pairs on the meta device. The loader may take views of them and of the
    parameters and copy the former into the latter; anything else raises LayoutMismatchError
    (module docstring). Afterwards every wire tensor must have been copied from at least once and
    every written parameter must be written exactly once, element for element.

    The model's parameters are not modified (copies are recorded, not run; any other write is
    refused before it runs; a loader that rebinds ``param.data`` gets it back). Memory: metadata
    only. Thread: the caller's, with the model otherwise idle."""
    import torch

    try:
        specs = [TensorSpec.coerce(s) for s in wire_specs]
    except TypeError as e:
        raise InvalidArgumentError(f"wire_specs: {e}") from None
    seen: set[str] = set()
    for spec in specs:
        if spec.name in seen:
            raise InvalidArgumentError(f"wire tensor '{spec.name}' is listed twice in wire_specs")
        seen.add(spec.name)
        if any(d < 0 for d in spec.shape):
            raise InvalidArgumentError(
                f"wire tensor '{spec.name}': negative dimension in shape "
                f"{format_shape(spec.shape)}")
    loader = load_weights if load_weights is not None else getattr(model, "load_weights", None)
    if not callable(loader):
        raise InvalidArgumentError(
            f"{type(model).__name__} has no load_weights method and no load_weights was given")

    params = list(model.named_parameters())
    # A stand-in (STAND_IN_FLAG) is a meta parameter on purpose.
    empty = [(n, p) for n, p in params
             if (p.device.type == "meta" and not getattr(p, STAND_IN_FLAG, False))
             or p.numel() == 0]
    if empty:
        listed = "; ".join(
            f"parameter '{n}' is {'on the meta device' if p.device.type == 'meta' else 'empty'} "
            f"(shape {format_shape(p.shape)})" for n, p in empty[:_MAX_LISTED])
        if len(empty) > _MAX_LISTED:
            listed += f"; ... and {len(empty) - _MAX_LISTED} more"
        raise LayoutMismatchError(
            f"{listed}: the engine prepacked or quantized these weights (or never allocated "
            f"them), so its parameters are not the weights it computes with and a receive plan "
            f"cannot write them; trace the model before its weights are processed after loading, "
            f"or turn off the engine's weight prepacking")

    sources = [torch.empty(s.shape, dtype=_torch_dtype(torch, s), device="meta") for s in specs]
    state = _State(specs, sources, params, list(model.named_buffers()))
    before = [(n, p, p.data) for n, p in params]

    def feed():
        for spec, source in zip(specs, sources):
            state.current_wire = spec.name
            yield spec.name, source
        state.current_wire = None

    mode = make_recording_mode(torch)(state)
    failure: BaseException | None = None
    try:
        with torch.no_grad(), mode:
            loader(feed())
    except _Refused:
        pass
    except Exception as e:  # noqa: BLE001 - the loader's own error, reported below
        failure = e

    replaced = []
    for n, p, data in before:
        now = p.data
        if (now.untyped_storage().data_ptr() != data.untyped_storage().data_ptr()
                or now.device != data.device or now.dtype != data.dtype
                or now.shape != data.shape or now.stride() != data.stride()
                or now.storage_offset() != data.storage_offset()):
            p.data = data  # give it back: tracing changes nothing
            replaced.append(n)
    if state.refusal is not None:
        raise state.refusal from failure
    if failure is not None:
        held = (f" (the last wire tensor it took: '{state.current_wire}')"
                if state.current_wire else "")
        raise LayoutMismatchError(
            f"the loader raised {type(failure).__name__}{held} on storage-less (meta) wire "
            f"tensors: {failure}; check that wire_specs match the model (names, shapes, dtypes)"
        ) from failure
    if replaced:
        raise LayoutMismatchError(
            f"the loader replaced the data of parameter(s) {_listing(replaced)} (param.data = "
            f"...) instead of copying into them: a receive plan only copies into the engine's "
            f"existing parameters")
    if state.computed:
        wire, op = next(iter(state.computed.values()))
        raise LayoutMismatchError(
            f"the loader computes ({op}) on '{state.wire_name(wire)}' (its result reaches no "
            f"parameter): {_WHAT_TO_DO_COMPUTE}")

    problems = []
    used = {c.wire for c in state.copies}
    unused = [s.name for s in specs if s.name not in used]
    if unused:
        problems.append(f"{len(unused)} wire tensor(s) the loader copies nowhere: "
                        f"{_listing(unused)}")
    by_param: dict[str, list[PlanCopy]] = {}
    for c in state.copies:
        by_param.setdefault(c.engine, []).append(c)
    coverage = []
    for n, p in params:
        if n not in by_param:
            continue
        missed, twice = _coverage(torch, p.numel(), by_param[n])
        if missed or twice:
            parts = []
            if missed:
                parts.append(f"{missed} of {p.numel()} elements not written")
            if twice:
                parts.append(f"{twice} elements written more than once")
            coverage.append(f"'{n}' ({', '.join(parts)})")
    if coverage:
        shown = "; ".join(coverage[:_MAX_LISTED])
        if len(coverage) > _MAX_LISTED:
            shown += f"; ... and {len(coverage) - _MAX_LISTED} more"
        problems.append(f"parameter(s) not written exactly once by the copies: {shown}")
    if problems:
        raise LayoutMismatchError(
            "the loader's copies do not make a receive plan: " + "; ".join(problems)
            + "; check that wire_specs are the trainer's tensors for this model")

    engine_params = {n: p for n, p in params if n in by_param}
    unwritten = [n for n, _ in params if n not in by_param]
    # Identity: each copy takes elements of a wire tensor to the same positions of the parameter
    # of the same name and shape (a loader may split a tensor into pieces, as for one fused on
    # disk); with the coverage checked above, every parameter written is then its wire tensor.
    shapes = {s.name: tuple(s.shape) for s in specs}
    identity = (
        len(by_param) == len(specs)
        and all(
            c.wire == c.engine and shapes[c.wire] == tuple(engine_params[c.engine].shape)
            and c.src_offset == c.dst_offset and _same_positions(c.shape, c.src_strides,
                                                                  c.dst_strides)
            for c in state.copies))
    return LoaderTrace(copies=state.copies, engine_params=engine_params, identity=identity,
                       unwritten_params=unwritten)
