"""shadowsync.sharding without torch: stand-in DTensors, Megatron slices and ZeRO-3 partitions.

Every sharding is checked the same way: the regions all ranks claim, as sets of flat element
indices, are disjoint and cover the tensor exactly (every byte sent once, by one rank)."""

import itertools
from math import prod

import pytest

from shadowsync.errors import InvalidArgumentError, NotSupportedError
from shadowsync.regions import ELEMENTS
from shadowsync.sharding import (
    dtensor_region,
    local_shard,
    local_shards,
    megatron_column_parallel,
    megatron_row_parallel,
    replicated,
    trainer_regions,
    zero3_partition,
)


# --- stand-ins with the duck-typed surface of torch's placements, DeviceMesh and DTensor ---

class Shard:
    def __init__(self, dim):
        self.dim = dim

    def is_shard(self):
        return True

    def is_replicate(self):
        return False

    def is_partial(self):
        return False

    def __repr__(self):
        return f"Shard(dim={self.dim})"


class Replicate:
    def is_shard(self):
        return False

    def is_replicate(self):
        return True

    def is_partial(self):
        return False

    def __repr__(self):
        return "Replicate()"


class Partial(Replicate):
    def is_replicate(self):
        return False

    def is_partial(self):
        return True

    def __repr__(self):
        return "Partial(sum)"


class _StridedShard(Shard):
    def __init__(self, dim, split_factor):
        super().__init__(dim)
        self.split_factor = split_factor

    def __repr__(self):
        return f"_StridedShard(dim={self.dim}, sf={self.split_factor})"


class Mesh:
    def __init__(self, shape, coordinate):
        self.shape, self.coordinate = tuple(shape), coordinate

    def size(self, i):
        return self.shape[i]

    def get_coordinate(self):
        return self.coordinate


class Tensor:
    """Shape only; detach/view/slicing as the module uses them."""

    def __init__(self, shape):
        self.shape = tuple(shape)

    def detach(self):
        return self


class DTensor:
    def __init__(self, shape, placements, mesh, local_shape=None):
        self.shape, self.placements, self.device_mesh = tuple(shape), placements, mesh
        if local_shape is not None:  # without one, the regions are checked on their own
            self.to_local = lambda: Tensor(local_shape)


def coordinates(mesh_shape):
    return list(itertools.product(*(range(n) for n in mesh_shape)))


def flat_indices(region, shape):
    """The row-major element indices a region covers."""
    if region.kind == ELEMENTS:
        return set(range(region.first, region.first + region.count))
    strides = [prod(shape[d + 1:]) for d in range(len(shape))]
    ranges = (range(b, e) for b, e in zip(region.begin, region.end))
    return {sum(i * s for i, s in zip(index, strides)) for index in itertools.product(*ranges)}


def assert_covers_once(regions, shape):
    """Disjoint, and together exactly the tensor's elements."""
    seen = set()
    for region in regions:
        indices = flat_indices(region, shape)
        assert not indices & seen, f"{region} overlaps another rank's region"
        seen |= indices
    assert seen == set(range(prod(shape))), f"not covered: {sorted(set(range(prod(shape))) - seen)}"


# --- FSDP2 / DTensor ---

@pytest.mark.parametrize("ranks", [2, 3, 4])
@pytest.mark.parametrize("shape,dim", [((13, 8), 0), ((13, 8), 1), ((3, 8), 0), ((3, 8), 1),
                                       ((8,), 0)])
def test_shard_regions_are_disjoint_and_cover(ranks, shape, dim):
    regions = [dtensor_region("w", DTensor(shape, [Shard(dim)], Mesh((ranks,), (r,))))
               for r in range(ranks)]
    assert_covers_once([r for r in regions if r is not None], shape)


def test_shard_follows_torch_chunk():
    # torch.chunk: ceil(n / k) per rank, the trailing ranks short or empty (no region).
    rows = [dtensor_region("w", DTensor((13, 8), [Shard(0)], Mesh((4,), (r,)))) for r in range(4)]
    assert [(r.begin, r.end) for r in rows] == [((0, 0), (4, 8)), ((4, 0), (8, 8)),
                                               ((8, 0), (12, 8)), ((12, 0), (13, 8))]
    few = [dtensor_region("b", DTensor((3, 8), [Shard(0)], Mesh((4,), (r,)))) for r in range(4)]
    assert [r and r.shape for r in few] == [(1, 8), (1, 8), (1, 8), None]
    # 5 rows over 4 ranks: chunks of 2, so rank 3 holds nothing though 5 > 4.
    five = [dtensor_region("v", DTensor((5,), [Shard(0)], Mesh((4,), (r,)))) for r in range(4)]
    assert [r and r.shape for r in five] == [(2,), (2,), (1,), None]


def test_local_tensor_agreeing_is_accepted_and_an_empty_shard_has_no_region():
    assert dtensor_region("w", DTensor((13, 8), [Shard(1)], Mesh((3,), (2,)), (13, 2))).shape == \
        (13, 2)
    assert dtensor_region("b", DTensor((3, 8), [Shard(0)], Mesh((4,), (3,)), (0, 8))) is None


def test_two_mesh_dims_compose():
    # The same tensor dim twice: the second mesh dim splits what the first left (13 -> 7 | 6,
    # then 7 -> 3 3 1 and 6 -> 2 2 2), as DTensor does.
    mesh_shape = (2, 3)
    regions = [dtensor_region("w", DTensor((13, 8), [Shard(0), Shard(0)], Mesh(mesh_shape, c)))
               for c in coordinates(mesh_shape)]
    assert [(r.begin[0], r.end[0]) for r in regions] == [(0, 3), (3, 6), (6, 7),
                                                         (7, 9), (9, 11), (11, 13)]
    assert_covers_once(regions, (13, 8))
    # Different dims: a grid of boxes.
    regions = [dtensor_region("w", DTensor((13, 8), [Shard(0), Shard(1)], Mesh((2, 3), c)))
               for c in coordinates((2, 3))]
    assert_covers_once(regions, (13, 8))


@pytest.mark.parametrize("placements", [[Shard(0), Replicate()], [Replicate(), Shard(0)]])
def test_replicate_mesh_dim_only_coordinate_zero_claims(placements):
    # FSDP + DDP, or HSDP (Replicate, Shard(0)): the replicas along the Replicate dim send
    # nothing, coordinate 0 there sends its shard.
    replicate_dim = 0 if placements[0].is_replicate() else 1
    mesh_shape = (2, 3)
    claimed = {}
    for c in coordinates(mesh_shape):
        region = dtensor_region("w", DTensor((13, 8), placements, Mesh(mesh_shape, c)))
        if c[replicate_dim] != 0:
            assert region is None, f"replica {c} claimed {region}"
        elif region is not None:
            claimed[c] = region
    assert_covers_once(claimed.values(), (13, 8))


def test_rank_outside_the_mesh_sends_nothing():
    assert dtensor_region("w", DTensor((13, 8), [Shard(0)], Mesh((2,), None))) is None


def test_fully_replicated_tensors_take_turns():
    # Plain tensors and all-Replicate DTensors: tensor i (in parameter order, counting only
    # those) is sent by rank i % world; sharded ones do not count.
    world = 3

    def params(rank):
        mesh = Mesh((world,), (rank,))
        return [("norm0", Tensor((8,))),
                ("w", DTensor((13, 8), [Shard(0)], mesh, None)),
                ("norm1", DTensor((8,), [Replicate()], mesh, (8,))),
                ("norm2", Tensor((8,))),
                ("bias", Tensor((4,))),
                ("scale", Tensor(()))]

    senders, rows_of_w = {}, []
    for rank in range(world):
        for region in trainer_regions(params(rank), rank=rank, world_size=world):
            if region.tensor == "w":  # sharded: every rank sends its rows
                rows_of_w.append(region)
                continue
            assert region.tensor not in senders, f"{region.tensor} sent twice"
            senders[region.tensor] = rank
    assert senders == {"norm0": 0, "norm1": 1, "norm2": 2, "bias": 0, "scale": 1}
    assert_covers_once(rows_of_w, (13, 8))


def test_plain_tensors_without_torch_distributed_are_rank_zeros():
    shards = local_shards([("a", Tensor((2,))), ("b", Tensor((3,)))])
    assert [(s.name, s.region.shape) for s in shards] == [("a", (2,)), ("b", (3,))]


def test_local_shard_of_a_dtensor_is_its_local_tensor():
    shard = local_shard("w", DTensor((13, 8), [Shard(0)], Mesh((2,), (1,)), (6, 8)))
    assert shard.tensor.shape == (6, 8) and shard.region.begin == (7, 0)


# --- refusals: each names the parameter, both values, and what to do ---

def test_partial_is_refused():
    with pytest.raises(InvalidArgumentError) as e:
        dtensor_region("grad_like", DTensor((4, 4), [Partial()], Mesh((2,), (0,))))
    text = str(e.value)
    assert "'grad_like'" in text and "Partial(sum)" in text
    assert "a pending reduction, not weights" in text and "redistribute" in text


def test_strided_shard_is_refused_by_name():
    with pytest.raises(NotSupportedError) as e:
        dtensor_region("layers.0.w", DTensor((8, 8), [_StridedShard(0, 2), Shard(0)],
                                              Mesh((2, 2), (0, 0))))
    text = str(e.value)
    assert "'layers.0.w'" in text and "_StridedShard" in text and "not supported yet" in text


def test_a_local_tensor_of_another_shape_is_refused():
    with pytest.raises(InvalidArgumentError) as e:
        dtensor_region("embed", DTensor((13, 8), [Shard(0)], Mesh((4,), (3,)), (3, 8)))
    text = str(e.value)
    assert "'embed'" in text and "(Shard(dim=0),)" in text
    assert "[1, 8]" in text and "[3, 8]" in text and "describe its region yourself" in text


def test_shard_of_a_dim_the_tensor_lacks_is_refused():
    with pytest.raises(InvalidArgumentError, match=r"'v'.*dim 1 of a tensor of shape \[8\]"):
        dtensor_region("v", DTensor((8,), [Shard(1)], Mesh((2,), (0,))))


def test_megatron_marked_plain_parameter_is_refused():
    param = Tensor((4, 8))
    param.tensor_model_parallel, param.partition_dim = True, 0
    with pytest.raises(NotSupportedError, match="'qkv'.*megatron_column_parallel"):
        trainer_regions([("qkv", param)], rank=0, world_size=2)


# --- Megatron ---

@pytest.mark.parametrize("tp", [2, 4])
def test_megatron_column_row_and_replicated_cover(tp):
    column = [megatron_column_parallel("qkv", (16, 8), r, tp) for r in range(tp)]
    assert all(r.shape == (16 // tp, 8) for r in column)
    assert_covers_once(column, (16, 8))
    row = [megatron_row_parallel("proj", (8, 16), r, tp) for r in range(tp)]
    assert all(r.shape == (8, 16 // tp) for r in row)
    assert_covers_once(row, (8, 16))
    bias = [replicated("proj.bias", (8,), sender_rank=1, rank=r) for r in range(tp)]
    assert [b is not None for b in bias] == [r == 1 for r in range(tp)]
    assert_covers_once([b for b in bias if b], (8,))


def test_megatron_indivisible_dim_is_refused():
    with pytest.raises(InvalidArgumentError) as e:
        megatron_column_parallel("embed", (50257, 8), 0, 4)
    text = str(e.value)
    assert "'embed'" in text and "dim 0" in text and "50257" in text and "tp_size 4" in text
    with pytest.raises(InvalidArgumentError, match=r"'proj'.*dim 1 of size 6.*tp_size 4"):
        megatron_row_parallel("proj", (8, 6), 1, 4)


# --- ZeRO-3 ---

class Flat(list):
    """A ds_tensor stand-in: a flat partition (numel, detach, view(-1), slicing)."""

    def numel(self):
        return len(self)

    def detach(self):
        return self

    def view(self, *shape):
        assert shape == (-1,)
        return self


class Zero3Param:
    def __init__(self, numel, rank, world):
        partition = -(-numel // world)
        self.ds_numel = numel
        # Rank r's partition holds elements r*p.. of the flat parameter, padded with -1.
        self.ds_tensor = Flat(i if i < numel else -1
                              for i in range(rank * partition, (rank + 1) * partition))


@pytest.mark.parametrize("numel,world", [(10, 4), (5, 4), (8, 4), (1, 2)])
def test_zero3_partitions_cover_and_leave_padding_out(numel, world):
    regions = [zero3_partition("w", Zero3Param(numel, r, world), r, world) for r in range(world)]
    assert_covers_once([r for r in regions if r is not None], (numel,))
    for rank in range(world):
        shard = local_shard("w", Zero3Param(numel, rank, world), rank=rank, world_size=world)
        assert -1 not in shard.tensor  # the padding is not sent
        if shard.region is not None:
            assert list(shard.tensor) == list(range(shard.region.first,
                                                    shard.region.first + shard.region.count))


def test_zero3_short_last_partition_and_a_rank_with_nothing():
    # 10 over 4: partitions of 3, the last holds 1.
    assert [(r.first, r.count) for r in (zero3_partition("w", Zero3Param(10, k, 4), k, 4)
                                         for k in range(4))] == [(0, 3), (3, 3), (6, 3), (9, 1)]
    # 5 over 4: partitions of 2; rank 3's would start at 6, past the end: nothing.
    assert zero3_partition("w", Zero3Param(5, 2, 4), 2, 4).count == 1
    assert zero3_partition("w", Zero3Param(5, 3, 4), 3, 4) is None


def test_zero3_world_size_too_small_is_refused():
    with pytest.raises(InvalidArgumentError, match=r"'w'.*2 partitions of 3 elements.*its 10"):
        zero3_partition("w", Zero3Param(10, 0, 4), 0, 2)
