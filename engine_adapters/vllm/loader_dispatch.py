"""The dispatch mode behind loader_trace: every operator the model's load_weights calls passes
through it, and it decides, by the operator's schema, whether the operator only reads metadata,
makes a view, copies a wire tensor into a parameter (recorded, not run) or must be refused."""

from __future__ import annotations

__all__ = ["make_recording_mode"]

# Operators that only read a tensor's metadata (they appear with symbolic shapes).
_METADATA_OPS = frozenset({
    "aten::sym_size",
    "aten::sym_stride",
    "aten::sym_numel",
    "aten::sym_storage_offset",
    "aten::is_same_size",
    "aten::size",
    "aten::stride",
    "aten::dim",
    "aten::numel",
    "prim::device",
    "prim::layout",
})

# In-place operators that change only the metadata of the tensor object they are called on
# (``t.t_()``), never the elements of its storage.
_METADATA_INPLACE_OPS = frozenset({
    "aten::t_",
    "aten::transpose_",
    "aten::swapdims_",
    "aten::swapaxes_",
    "aten::squeeze_",
    "aten::unsqueeze_",
    "aten::as_strided_",
    "aten::detach_",
})


def make_recording_mode(torch):
    """The TorchDispatchMode class that runs the loader over a trace's state (loader_trace._State):
    views run, copies into parameters are recorded and not executed, anything else that touches
    a wire tensor or writes a parameter is refused before it runs."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten, tree_map

    def op_name(func) -> str:
        return func._schema.name

    def written_args(func, args, kwargs) -> list:
        """The tensors an operator writes (its schema marks them ``Tensor(a!)``)."""
        written = []
        schema = func._schema
        for i, arg in enumerate(schema.arguments):
            info = arg.alias_info
            if info is None or not info.is_write:
                continue
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            flat, _ = tree_flatten(value)
            written.extend(v for v in flat if isinstance(v, torch.Tensor))
        return written

    def is_view(func) -> bool:
        schema = func._schema
        if any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments):
            return False
        returns = schema.returns
        return bool(returns) and all(r.alias_info is not None for r in returns)

    class _TraceMode(TorchDispatchMode):
        def __init__(self, state):  # loader_trace._State
            super().__init__()
            self.state = state

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            st = self.state
            name = op_name(func)
            tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
            wires = [(t, st.wire_index(t)) for t in tensors]
            wires = [(t, w) for t, w in wires if w is not None]
            computed = [(t, st.computed_from(t)) for t in tensors]
            computed = [(t, c) for t, c in computed if c is not None]

            if name == "aten::copy_" and len(args) >= 2:
                dst, src = args[0], args[1]
                src_wire = st.wire_index(src)
                src_computed = st.computed_from(src)
                if st.wire_index(dst) is not None:
                    wire = st.wire_index(dst)
                    st.refuse(f"the loader writes into wire tensor '{st.wire_name(wire)}' "
                              f"({name}): a receive plan never modifies the trainer's tensors")
                candidates = st.param_storage(dst)
                if src_wire is not None:
                    if candidates is None:
                        st.refuse(f"the loader copies wire tensor '{st.wire_name(src_wire)}' "
                                  f"into {st.describe_target(dst)} ({name}): a receive plan "
                                  f"copies only into the model's parameters")
                    st.record_copy(dst, src, src_wire, candidates)
                    return dst  # recorded, not executed
                if src_computed is not None:
                    wire, op = src_computed
                    param = None
                    if candidates is not None:
                        param = st.locate(dst, candidates, name, st.wire_name(wire))[0]
                    st.refuse_compute(op, wire, param)

            written = written_args(func, args, kwargs)
            if name not in _METADATA_INPLACE_OPS:
                for t in written:
                    w = st.wire_index(t)
                    if w is not None:
                        st.refuse(f"the loader modifies wire tensor '{st.wire_name(w)}' in "
                                  f"place ({name}): a receive plan never modifies the "
                                  f"trainer's tensors")
                    candidates = st.param_storage(t)
                    if candidates is None or t.numel() == 0:
                        continue
                    param = candidates[0][0]
                    for cname, p in candidates:
                        rel = t.storage_offset() - p.storage_offset()
                        if 0 <= rel < p.numel():
                            param = cname
                            break
                    if wires or computed:
                        wire = wires[0][1] if wires else computed[0][1][0]
                        st.refuse_compute(name, wire, param)
                    st.refuse(f"the loader writes {t.numel()} elements of parameter '{param}' "
                              f"with {name} without taking them from a wire tensor (e.g. "
                              f"zeroing the padding rows of a padded vocabulary, or an "
                              f"initialisation): a receive plan only copies the trainer's "
                              f"tensors, and the engine would keep these elements from before; "
                              f"make the engine's parameter exactly the trainer's tensor (no "
                              f"padding) or let the engine load this weight itself")
                    raise AssertionError  # unreachable

            if not wires and not computed:
                return func(*args, **kwargs)
            if name in _METADATA_OPS or name in _METADATA_INPLACE_OPS:
                return func(*args, **kwargs)
            if is_view(func) and not computed:
                return func(*args, **kwargs)  # a view of a wire tensor, on the meta device

            # A computation on a wire tensor (or a view of a computed result). It cannot be a
            # plan; run it on the meta device (computes nothing) so that the refusal can name the
            # parameter its result is copied into.
            wire = wires[0][1] if wires else computed[0][1][0]
            origin = computed[0][1][1] if computed and not wires else name
            if written:
                # writes a real tensor that is not a parameter (checked above): a temporary
                st.refuse_compute(name, wire, None)

            def to_meta(v):
                if isinstance(v, torch.Tensor) and v.device.type != "meta":
                    return torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="meta")
                return v

            try:
                out = func(*tree_map(to_meta, args), **tree_map(to_meta, kwargs))
            except Exception:  # noqa: BLE001 - e.g. .item() on meta: refuse, naming the op
                st.refuse_compute(name, wire, None)
            flat_out = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
            if not flat_out:
                st.refuse_compute(name, wire, None)
            for t in flat_out:
                sid = st._storage_id(t)
                if sid is not None and sid not in st.wire_of:
                    st.computed.setdefault(sid, (wire, origin))
                    st.computed_keep.append(t)
            return out

    return _TraceMode
