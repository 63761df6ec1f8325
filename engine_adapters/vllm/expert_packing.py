"""vLLM CPU's MoE experts: kept in the order its grouped GEMM reads, and written there by the plan.

After loading, vLLM's CPU backend repacks each MoE layer's stacked experts (``w13_weight``,
``w2_weight``) for its grouped GEMM (``prepack_moe_weight``: blocks of rows transposed, on AMX
with pairs of columns interleaved): same shape, same dtype, the elements in another order, and
the layer computes from that order. An update written in the checkpoint's order would be silently
wrong; written in the packed order it is what a fresh engine holds.

The order is not guessed from vLLM's source. At set-up vLLM's own prepack op runs on one expert
whose elements hold their own index (in base-256 digits, exact in every float dtype): that gives
the permutation, which is folded into nested strided dimensions (``PackedOrder``) and checked
against the op on random data of the parameter's full shape, bit for bit. ``compose`` then turns
each copy of the receive plan (a wire tensor into a region of the parameter as loaded) into copies
into the packed positions, so the receiver writes the packed order directly: no staging, no
transform step, one pass. A repacking that is not such a permutation is refused, named.

torch and vllm are imported inside the functions only."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from shadowsync.errors import LayoutMismatchError
from shadowsync.layout import format_shape
from shadowsync.receive_plan import PlanCopy

__all__ = ["PackedOrder", "cpu_expert_packing", "compose", "compose_all"]

_PACKED_PARAMS = ("w13_weight", "w2_weight")
_DIGIT_BASE = 256  # every float dtype vLLM serves holds 0..255 exactly


@dataclass(frozen=True)
class Digit:
    """One dimension of a packed order: `size` positions, `logical` elements apart in the tensor
    as loaded and `packed` elements apart in the packed tensor."""

    size: int
    logical: int
    packed: int


@dataclass(frozen=True)
class PackedOrder:
    """Where each element of a tensor as loaded sits in its packed copy: the logical index in
    mixed radix (digits sorted by their logical stride, the innermost first), each digit moved by
    its packed stride."""

    digits: tuple[Digit, ...]

    def packed_offset(self, logical: int) -> int:
        return sum((logical // d.logical) % d.size * d.packed for d in self.digits)


def cpu_expert_packing(layer, layer_name: str) -> dict[str, PackedOrder] | None:
    """{parameter name: PackedOrder} for a vLLM CPU MoE layer whose experts its grouped GEMM
    repacked after loading, checked against vLLM's own op; None for any other layer (zentorch's
    kernels, which keep the loaded order, included). Raises LayoutMismatchError naming the layer
    when the repacking is not a permutation it can express."""
    experts = getattr(getattr(getattr(layer, "quant_method", None), "moe_kernel", None),
                      "fused_experts", None)
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:
        return None
    if not isinstance(experts, CPUUnquantizedExperts) or getattr(experts, "_use_zentorch", False):
        return None
    orders = {}
    for pname in _PACKED_PARAMS:
        weight = layer._parameters.get(pname)
        if weight is None or weight.dim() != 3:
            return None
        key = (experts.isa, tuple(weight.shape), weight.dtype)
        if key not in _DERIVED:  # every layer of a model has the same shapes: derived once
            _DERIVED[key] = _derive(experts.isa, weight, f"{layer_name}.{pname}")
        orders[f"{layer_name}.{pname}"] = _DERIVED[key]
    return orders


# (isa, shape, dtype) -> the order vLLM's op packs such a parameter in, derived and verified once
# per process: the op is a function of these alone (its expert weights' values do not matter).
_DERIVED: dict = {}


def _prepack(torch, x, isa: str):
    out = torch.empty_like(x)
    torch.ops._C.prepack_moe_weight(x, out, isa)
    return out


def _derive(isa: str, weight, name: str) -> PackedOrder:
    """The packed order of `weight` ([experts, rows, columns]) from vLLM's op, verified."""
    import torch

    experts, rows, columns = weight.shape
    n = rows * columns
    index = torch.arange(n, dtype=torch.int64)
    packed = torch.zeros(n, dtype=torch.int64)
    scale, remaining = 1, n - 1
    while True:  # one pass per base-256 digit of the largest index
        digit = ((index // scale) % _DIGIT_BASE).to(weight.dtype).reshape(1, rows, columns)
        moved = _prepack(torch, digit, isa).reshape(-1).to(torch.int64)
        packed += moved * scale
        remaining //= _DIGIT_BASE
        if remaining == 0:
            break
        scale *= _DIGIT_BASE
    if not torch.equal(torch.bincount(packed, minlength=n), torch.ones(n, dtype=torch.int64)):
        raise LayoutMismatchError(
            f"parameter '{name}': vLLM's CPU expert repacking (prepack_moe_weight, isa '{isa}') "
            f"does not only reorder the elements of one expert {format_shape((rows, columns))}; "
            f"an update cannot be written in its order")
    digits = _fold(torch, packed, name) + [Digit(experts, n, n)]
    order = PackedOrder(tuple(sorted(digits, key=lambda d: d.logical)))
    _check_radix(order, experts * n, name)
    # The op on random data of the full shape, bit for bit: every expert packed the same way.
    generator = torch.Generator().manual_seed(0)
    sample = torch.randn(tuple(weight.shape), generator=generator).to(weight.dtype)
    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[sample.element_size()]
    expected = _prepack(torch, sample, isa).reshape(-1).view(bits)
    source = _logical_of_packed(torch, order, experts * n)
    if not torch.equal(sample.reshape(-1).view(bits)[source], expected):
        raise LayoutMismatchError(
            f"parameter '{name}' {format_shape(tuple(weight.shape))}: vLLM's CPU expert "
            f"repacking (isa '{isa}') packs the experts differently from the order derived from "
            f"one of them; an update cannot be written in its order")
    return order


def _fold(torch, packed, name: str) -> list[Digit]:
    """Nested strided dimensions of a permutation (packed position -> logical index), the
    innermost first: each level repeats the block of the levels inside it at one logical step."""
    n = packed.numel()
    digits, block = [], 1
    while block < n:
        step = int(packed[block] - packed[0])
        count = n // block
        rows = packed[:count * block].reshape(count, block) - packed[:block]
        expected = torch.arange(count, dtype=torch.int64).reshape(count, 1) * step
        good = (rows == expected).all(dim=1)
        repeats = count if bool(good.all()) else int((~good).nonzero()[0])
        if repeats < 2 or n % (block * repeats):
            raise LayoutMismatchError(
                f"parameter '{name}': vLLM's CPU expert repacking is not a nested strided "
                f"reordering (it breaks after {block} elements); an update cannot be written in "
                f"its order")
        digits.append(Digit(repeats, step, block))
        block *= repeats
    return digits


def _check_radix(order: PackedOrder, n: int, name: str) -> None:
    stride = 1
    for d in order.digits:
        if d.logical != stride:
            raise LayoutMismatchError(
                f"parameter '{name}': the packed order's logical strides "
                f"{[x.logical for x in order.digits]} do not count every element once")
        stride *= d.size
    if stride != n:
        raise LayoutMismatchError(f"parameter '{name}': the packed order covers {stride} of "
                                  f"{n} elements")


def _logical_of_packed(torch, order: PackedOrder, n: int):
    """For each packed position, the logical index whose element lands there."""
    logical = torch.arange(n, dtype=torch.int64)
    packed = torch.zeros(n, dtype=torch.int64)
    for d in order.digits:
        packed += (logical // d.logical) % d.size * d.packed
    source = torch.empty(n, dtype=torch.int64)
    source[packed] = logical
    return source


# --- the plan's copies into the packed order --------------------------------------------------

def compose_all(copies: list[PlanCopy], orders: dict[str, PackedOrder]) -> list[PlanCopy]:
    """`copies` with every copy into a packed parameter rewritten into its packed positions."""
    if not orders:
        return list(copies)
    out = []
    for c in copies:
        out.extend(compose(c, orders[c.engine]) if c.engine in orders else [c])
    return out


def compose(copy: PlanCopy, order: PackedOrder) -> list[PlanCopy]:
    """`copy` (into the parameter as loaded) as copies into its packed positions: each of its
    dimensions split along the order's digits; a dimension that crosses a digit unaligned is cut
    at the boundary first, one that strides across digits is cut into single elements."""
    done, todo = [], [copy]
    while todo:
        c = todo.pop()
        result = _compose_aligned(c, order)
        if isinstance(result, PlanCopy):
            done.append(result)
        else:
            todo.extend(result)
    return done


def _compose_aligned(c: PlanCopy, order: PackedOrder) -> PlanCopy | list[PlanCopy]:
    digits = order.digits
    by_stride = {d.logical: i for i, d in enumerate(digits)}
    start = [(c.dst_offset // d.logical) % d.size for d in digits]
    used: set[int] = set()
    dims: list[tuple[int, int, int]] = []  # (size, wire stride, packed stride)
    for j, (size, src, dst) in enumerate(zip(c.shape, c.src_strides, c.dst_strides)):
        if size == 1:
            continue
        i = by_stride.get(dst)
        if i is None:
            return _cut(c, j, 1)
        count, wire = size, src
        while True:
            d = digits[i]
            if i in used:
                return _cut(c, j, 1)
            if start[i] + count <= d.size:
                dims.append((count, wire, d.packed))
                used.add(i)
                break
            if start[i] == 0 and count % d.size == 0 and i + 1 < len(digits):
                dims.append((d.size, wire, d.packed))
                used.add(i)
                count //= d.size
                wire *= d.size
                i += 1
                continue
            # Crossing into the next digit unaligned: cut where the carry would start.
            per_position = size // count  # copy positions per step of this digit
            fits = d.size - start[i] if start[i] else (count // d.size) * d.size
            return _cut(c, j, fits * per_position)
    dims.sort(key=lambda dim: -dim[1])  # the wire read in order; its rows innermost
    return dataclasses.replace(
        c, shape=tuple(d[0] for d in dims) or (1,),
        src_strides=tuple(d[1] for d in dims) or (1,),
        dst_offset=order.packed_offset(c.dst_offset),
        dst_strides=tuple(d[2] for d in dims) or (1,))


def _cut(c: PlanCopy, j: int, first: int) -> list[PlanCopy]:
    """`c` cut along dimension `j`: its first `first` positions (one by one when `first` is 1,
    every position then) and the rest."""
    size = c.shape[j]
    if first <= 0 or first >= size:
        first = 1
    pieces = []
    bounds = list(range(0, size, 1)) if first == 1 else [0, first]
    for k, lo in enumerate(bounds):
        hi = bounds[k + 1] if k + 1 < len(bounds) else size
        shape = list(c.shape)
        shape[j] = hi - lo
        pieces.append(dataclasses.replace(
            c, shape=tuple(shape), src_offset=c.src_offset + lo * c.src_strides[j],
            dst_offset=c.dst_offset + lo * c.dst_strides[j]))
    return pieces
