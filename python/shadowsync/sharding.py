"""What this trainer rank sends of each parameter, read from how the trainer shards it (§14).

A sharded trainer already holds every byte somewhere; the sync sends each byte from the rank
that holds it, so no rank ever gathers a full tensor. This module turns a rank's view of its
parameters into ``TensorRegion``s, locally, without any collective:

* FSDP2 / DTensor (``dtensor_region``): ``Shard(d)`` follows ``torch.chunk``: ceil(n / k) rows
  per mesh coordinate, the trailing coordinates short or empty; several mesh dims sharding
  compose left to right, as DTensor does. Along a ``Replicate`` mesh dim only coordinate 0
  claims (the HSDP replicas send nothing).
* Megatron tensor parallelism (``megatron_column_parallel``, ``megatron_row_parallel``,
  ``replicated``): even slices of dim 0 or dim 1; norms and row-parallel biases are replicated
  and one rank sends them.
* DeepSpeed ZeRO-3 (``zero3_partition``): a flat element range of the flattened parameter.

A tensor replicated on every rank (an all-``Replicate`` DTensor, a plain tensor) is sent by
exactly one rank: the one at flat rank ``(its index among such tensors, in parameter order) %
world``, so the load spreads over the ranks. Every rank, and the engine side computing the
routing plan, must therefore walk the parameters in the same order (``named_parameters()`` of
the same model gives it).

``forbid_gathers()`` turns the promise into a check: inside it, the gathers of torch.distributed
and DTensor raise ``GatherForbidden``.

Placements are duck-typed (``is_shard()``, ``is_replicate()``, ``is_partial()``, ``.dim``), so
this module imports without torch and is tested with stand-ins; only ``forbid_gathers`` and the
default rank look torch up, and only when asked.
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass
from math import prod
from typing import Any, Iterable, Iterator, Sequence

from .errors import InvalidArgumentError, NotSupportedError
from .regions import TensorRegion

__all__ = [
    "GatherForbidden",
    "LocalShard",
    "dtensor_region",
    "forbid_gathers",
    "local_shard",
    "local_shards",
    "megatron_column_parallel",
    "megatron_row_parallel",
    "replicated",
    "trainer_regions",
    "zero3_partition",
]


class GatherForbidden(RuntimeError):
    """A gather was called inside ``forbid_gathers()``."""


@dataclass(frozen=True)
class LocalShard:
    """What this rank holds of parameter ``name``: ``tensor`` (its local data, detached, no copy)
    and ``region``, where ``tensor`` sits in the full parameter; ``region`` is None where this
    rank sends nothing of it (another rank holds the same bytes and sends them, or it holds
    none)."""

    name: str
    tensor: Any
    region: TensorRegion | None


# ---------------------------------------------------------------------------------------------
# FSDP2 / DTensor


def _is_dtensor(param) -> bool:
    return hasattr(param, "placements") and hasattr(param, "device_mesh")


def _chunk(size: int, parts: int, index: int) -> tuple[int, int]:
    """[begin, end) of chunk ``index`` of ``size`` items split as torch.chunk does: every chunk
    ceil(size / parts) long, the trailing ones short or empty (begin == end)."""
    chunk = -(-size // parts)
    begin = min(size, index * chunk)
    return begin, min(size, begin + chunk)


def _check_placement(name: str, param, placement) -> None:
    # _StridedShard (FSDP2 over a TP-sharded dim) claims is_shard() on some versions, but its
    # rows interleave: a box would name the wrong rows. Checked first, by name.
    if type(placement).__name__ == "_StridedShard" or hasattr(placement, "split_factor"):
        raise NotSupportedError(
            f"parameter '{name}': placement {placement!r} in {tuple(param.placements)} is a "
            f"_StridedShard (FSDP2 over a tensor-parallel dim), which is not supported yet; "
            f"shard it with FSDP2 or TP alone, or sync it with a gather outside shadowsync")
    if placement.is_partial():
        raise InvalidArgumentError(
            f"parameter '{name}': placement {placement!r} in {tuple(param.placements)} is "
            f"Partial, a pending reduction, not weights; redistribute it to Shard or Replicate "
            f"before the sync (the optimizer step does)")
    if not (placement.is_shard() or placement.is_replicate()):
        raise NotSupportedError(
            f"parameter '{name}': placement {placement!r} in {tuple(param.placements)} is "
            f"neither Shard nor Replicate; only those are supported")


def _is_fully_replicated(name: str, param) -> bool:
    for placement in param.placements:
        _check_placement(name, param, placement)
    return all(p.is_replicate() for p in param.placements)


def _local_tensor(param):
    """The DTensor's local tensor (``to_local()`` without its autograd view), where the object
    has one (stand-ins in tests may not)."""
    local = getattr(param, "_local_tensor", None)
    if local is None and hasattr(param, "to_local"):
        local = param.to_local()
    return local


def dtensor_region(name: str, param, *, replicated_index: int = 0) -> TensorRegion | None:
    """The region this rank sends of DTensor ``param``; None when it sends nothing of it (an
    empty trailing shard, a replica along a Replicate mesh dim, a rank outside the mesh).

    Computed from the placements, the mesh coordinate and the global shape alone: no collective,
    no full tensor. The result is checked against the local tensor's shape. ``replicated_index``
    matters only for a tensor Replicate on every mesh dim: its index among such tensors in
    parameter order; the mesh's flat (row-major) coordinate ``replicated_index % mesh size``
    sends it. Raises InvalidArgumentError for a Partial placement or a local tensor whose shape
    disagrees, NotSupportedError for _StridedShard. Pure; any thread."""
    mesh = param.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:  # this rank is not in the mesh: it holds nothing
        return None
    placements = tuple(param.placements)
    shape = tuple(int(d) for d in param.shape)
    mesh_sizes = tuple(int(mesh.size(i)) for i in range(len(placements)))
    fully_replicated = _is_fully_replicated(name, param)

    begin, end = [0] * len(shape), list(shape)
    for mesh_dim, placement in enumerate(placements):
        if not placement.is_shard():
            continue
        dim = placement.dim if placement.dim >= 0 else placement.dim + len(shape)
        if not 0 <= dim < len(shape):
            raise InvalidArgumentError(
                f"parameter '{name}': placement {placement!r} in {placements} shards dim "
                f"{placement.dim} of a tensor of shape {list(shape)}; give a dim the tensor has")
        # A later mesh dim splits what the earlier ones left this rank (left to right, as
        # DTensor's compute_local_shape_and_global_offset does).
        first, last = _chunk(end[dim] - begin[dim], mesh_sizes[mesh_dim], coordinate[mesh_dim])
        begin[dim], end[dim] = begin[dim] + first, begin[dim] + last

    local_shape = tuple(e - b for b, e in zip(begin, end))
    local = _local_tensor(param)
    if local is not None and tuple(local.shape) != local_shape:
        raise InvalidArgumentError(
            f"parameter '{name}': placements {placements} on mesh {list(mesh_sizes)} at "
            f"coordinate {list(coordinate)} give a local shard of shape {list(local_shape)} but "
            f"the local tensor has shape {list(local.shape)}; shadowsync expects torch.chunk's "
            f"split (what distribute_tensor and fully_shard make): re-shard the parameter so, "
            f"or describe its region yourself")

    if fully_replicated:
        flat = 0
        for size, index in zip(mesh_sizes, coordinate):
            flat = flat * size + index
        if flat != replicated_index % prod(mesh_sizes):
            return None
    elif any(p.is_replicate() and coordinate[i] != 0 for i, p in enumerate(placements)):
        return None  # a replica along a Replicate mesh dim: coordinate 0 there sends
    if 0 in local_shape:
        return None  # an empty trailing shard
    if not shape:
        return TensorRegion.whole(name, shape)
    return TensorRegion.box(name, begin, end)


# ---------------------------------------------------------------------------------------------
# Megatron tensor parallelism


def _megatron_slice(name: str, full_shape: Sequence[int], dim: int, tp_rank: int, tp_size: int,
                    kind: str) -> TensorRegion:
    shape = tuple(int(d) for d in full_shape)
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise InvalidArgumentError(
            f"tensor '{name}': tp_rank {tp_rank} of tp_size {tp_size}; give "
            f"0 <= tp_rank < tp_size")
    if len(shape) <= dim:
        raise InvalidArgumentError(
            f"tensor '{name}': a {kind} slice splits dim {dim}, but the full shape "
            f"{list(shape)} has {len(shape)} dims; give the full (unsplit) shape")
    if shape[dim] % tp_size:
        raise InvalidArgumentError(
            f"tensor '{name}': dim {dim} of size {shape[dim]} does not divide by tp_size "
            f"{tp_size}; Megatron splits {kind} tensors evenly: pad the full shape as the "
            f"model does (make_vocab_size_divisible_by for embeddings) and give that")
    part = shape[dim] // tp_size
    begin, end = [0] * len(shape), list(shape)
    begin[dim], end[dim] = tp_rank * part, (tp_rank + 1) * part
    return TensorRegion.box(name, begin, end)


def megatron_column_parallel(name: str, full_shape: Sequence[int], tp_rank: int,
                             tp_size: int) -> TensorRegion:
    """Rank ``tp_rank``'s slice of dim 0: a column-parallel weight [out, in] (and its bias), a
    vocab-parallel embedding. Raises InvalidArgumentError where tp_size does not divide dim 0.
    Pure; any thread."""
    return _megatron_slice(name, full_shape, 0, tp_rank, tp_size, "column-parallel")


def megatron_row_parallel(name: str, full_shape: Sequence[int], tp_rank: int,
                          tp_size: int) -> TensorRegion:
    """Rank ``tp_rank``'s slice of dim 1 of a row-parallel weight [out, in]. Its bias is whole on
    every rank: ``replicated``. Raises InvalidArgumentError where tp_size does not divide dim 1.
    Pure; any thread."""
    return _megatron_slice(name, full_shape, 1, tp_rank, tp_size, "row-parallel")


def replicated(name: str, shape: Sequence[int], *, sender_rank: int,
               rank: int) -> TensorRegion | None:
    """A tensor every rank holds whole (a norm, a row-parallel bias): only ``sender_rank`` claims
    it, the others send nothing. Pure; any thread."""
    return TensorRegion.whole(name, shape) if rank == sender_rank else None


# ---------------------------------------------------------------------------------------------
# DeepSpeed ZeRO-3


def _is_zero3(param) -> bool:
    return hasattr(param, "ds_tensor") and hasattr(param, "ds_numel")


def _zero3_count(name: str, param, rank: int, world_size: int) -> tuple[int, int]:
    numel, partition = int(param.ds_numel), int(param.ds_tensor.numel())
    if world_size < 1 or not 0 <= rank < world_size:
        raise InvalidArgumentError(
            f"parameter '{name}': rank {rank} of world size {world_size}; give "
            f"0 <= rank < world_size (of the group ZeRO-3 partitions over)")
    if partition * world_size < numel:
        raise InvalidArgumentError(
            f"parameter '{name}': {world_size} partitions of {partition} elements cannot hold "
            f"its {numel} (ds_numel); give the world size of the group ZeRO-3 partitions over")
    first = rank * partition
    return first, min(partition, numel - first)


def zero3_partition(name: str, param, rank: int, world_size: int) -> TensorRegion | None:
    """The flat element range rank ``rank`` holds of a ZeRO-3 parameter: its ``ds_tensor``
    partition (ds_tensor.numel() elements, the last one padded past ``ds_numel``); None for a
    rank whose partition is all padding. The local data is ``ds_tensor.view(-1)[:count]``.
    Pure; any thread."""
    first, count = _zero3_count(name, param, rank, world_size)
    return TensorRegion.elements(name, first, count) if count > 0 else None


# ---------------------------------------------------------------------------------------------
# A rank's parameters


def _default_rank_world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    # torch.distributed can only be initialized if torch was imported: no import just to ask.
    dist = sys.modules.get("torch.distributed")
    initialized = dist is not None and dist.is_available() and dist.is_initialized()
    if rank is None:
        rank = dist.get_rank() if initialized else 0
    if world_size is None:
        world_size = dist.get_world_size() if initialized else 1
    return rank, world_size


def _refuse_megatron_marked(name: str, param) -> None:
    # Megatron marks its split parameters; taken for plain tensors, their local slice would be
    # claimed as the whole tensor.
    if getattr(param, "tensor_model_parallel", False):
        raise NotSupportedError(
            f"parameter '{name}' is a Megatron tensor-parallel slice (tensor_model_parallel, "
            f"partition_dim {getattr(param, 'partition_dim', '?')}) whose full shape this rank "
            f"cannot see; describe it with megatron_column_parallel / megatron_row_parallel")


def _shard(name: str, param, replicated_index: int, rank: int, world_size: int) -> LocalShard:
    if _is_dtensor(param):
        region = dtensor_region(name, param, replicated_index=replicated_index)
        local = _local_tensor(param)
        return LocalShard(name, None if local is None else local.detach(), region)
    if _is_zero3(param):
        first, count = _zero3_count(name, param, rank, world_size)
        flat = param.ds_tensor.detach().view(-1)
        if count <= 0:
            return LocalShard(name, flat[:0], None)
        return LocalShard(name, flat[:count], TensorRegion.elements(name, first, count))
    _refuse_megatron_marked(name, param)
    sender = replicated_index % world_size
    return LocalShard(name, param.detach(),
                      replicated(name, param.shape, sender_rank=sender, rank=rank))


def _replicated_everywhere(name: str, param) -> bool:
    """Whether every rank holds all of ``param`` (a plain tensor, an all-Replicate DTensor): those
    take turns sending."""
    if _is_dtensor(param):
        return _is_fully_replicated(name, param)
    return not _is_zero3(param)


def _walk(named_parameters, rank, world_size) -> Iterator[LocalShard]:
    rank, world_size = _default_rank_world(rank, world_size)
    replicated_index = 0
    for name, param in named_parameters:
        yield _shard(name, param, replicated_index, rank, world_size)
        if _replicated_everywhere(name, param):
            replicated_index += 1


def local_shard(name: str, param, *, replicated_index: int = 0, rank: int | None = None,
                world_size: int | None = None) -> LocalShard:
    """What this rank holds of one parameter: a DTensor (FSDP2), a ZeRO-3 parameter, or a plain
    tensor (every rank holds it whole). ``replicated_index`` is, for a tensor every rank holds
    whole, its index among such tensors in parameter order (``local_shards`` counts it for you).
    ``rank``/``world_size`` (plain and ZeRO-3 tensors) default to torch.distributed's where it
    is initialized, else 0 and 1. No collective, no copy. Any thread."""
    rank, world_size = _default_rank_world(rank, world_size)
    return _shard(name, param, replicated_index, rank, world_size)


def local_shards(named_parameters: Iterable[tuple[str, Any]], *, rank: int | None = None,
                 world_size: int | None = None) -> list[LocalShard]:
    """``local_shard`` of every parameter, in order, counting the tensors every rank holds whole
    so that they take turns sending. Every rank must give the same parameters in the same
    order. No collective, no copy. Any thread."""
    return list(_walk(named_parameters, rank, world_size))


def trainer_regions(named_parameters: Iterable[tuple[str, Any]], *, rank: int | None = None,
                    world_size: int | None = None) -> list[TensorRegion]:
    """The regions this rank sends, in parameter order (a parameter it sends nothing of has
    none): what the routing plan needs from it. As ``local_shards``."""
    return [s.region for s in _walk(named_parameters, rank, world_size) if s.region is not None]


# ---------------------------------------------------------------------------------------------
# The check that nothing gathers


# (module, attribute) pairs that gather. torch.distributed re-exports distributed_c10d's
# functions, and torch's own code calls either name, so both are covered. A name someone bound
# with `from torch.distributed import all_gather` before arming is not.
_GATHERS = [
    ("torch.distributed.tensor", "DTensor.full_tensor"),
    ("torch.distributed.tensor", "DTensor.redistribute"),
    *[(module, fn) for module in ("torch.distributed", "torch.distributed.distributed_c10d")
      for fn in ("all_gather", "all_gather_into_tensor", "all_gather_object",
                 "_all_gather_base", "all_gather_single")],
    ("torch.distributed._functional_collectives", "all_gather_tensor"),
    ("torch.distributed._functional_collectives", "all_gather_tensor_autograd"),
    ("torch.distributed._functional_collectives", "all_gather_into_tensor_coalesced"),
]


_INHERITED = object()


def _forbidden(name: str):
    def refuse(*args, **kwargs):
        raise GatherForbidden(
            f"{name} called inside shadowsync.sharding.forbid_gathers(): a sharded sync sends "
            f"each rank's own shard (local_shard / trainer_regions) and never gathers a full "
            f"tensor; find the caller in the traceback and give it the local shard instead")
    return refuse


@contextlib.contextmanager
def forbid_gathers():
    """While armed, the gathers of torch.distributed, its functional collectives and DTensor
    (full_tensor, redistribute) raise GatherForbidden; the originals come back on exit, also
    after an exception. It patches module attributes, so it holds for the whole process: arm it
    around a sync, not while another thread trains. Nests."""
    import importlib

    saved = []
    try:
        for module_name, path in _GATHERS:
            owner = importlib.import_module(module_name)
            *outer, attr = path.split(".")
            for part in outer:
                owner = getattr(owner, part)
            if not hasattr(owner, attr):  # not in this torch version
                continue
            # vars(), not getattr(): a method inherited by the class is put back by deleting
            # the patch, not by pinning a copy on the subclass.
            saved.append((owner, attr, vars(owner).get(attr, _INHERITED)))
            setattr(owner, attr, _forbidden(f"{module_name}.{path}"))
        yield
    finally:
        for owner, attr, original in reversed(saved):
            if original is _INHERITED:
                delattr(owner, attr)
            else:
                setattr(owner, attr, original)
