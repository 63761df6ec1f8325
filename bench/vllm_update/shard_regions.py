"""Where each rank of an FSDP2-like sharded trainer holds its rows: every parameter split along
dimension 0 (FSDP2's Shard(0)) the way torch.chunk splits it, which is how FSDP2 cuts a dimension
that M does not divide: ceil(rows / M) rows a rank, the last ranks fewer, possibly none. A scalar is rank 0's."""

from __future__ import annotations


def shard0_regions(specs: list, count: int) -> list[list]:
    """Each of `count` trainer ranks' regions of `specs` ((name, dtype, shape) triples), as
    ShadowsyncInitInfo.trainer_ranks["regions"] carries them: ``[name, "box", begin, end]`` per
    tensor the rank holds rows of (a rank with no rows of a tensor has no region of it)."""
    regions: list[list] = [[] for _ in range(count)]
    for name, _, shape in specs:
        shape = list(shape)
        if not shape:  # a scalar: rank 0 holds it
            regions[0].append([name, "box", [], []])
            continue
        rows = -(-shape[0] // count)  # torch.chunk's chunk size
        for rank in range(count):
            begin, end = rank * rows, min(shape[0], (rank + 1) * rows)
            if begin < end:
                regions[rank].append([name, "box", [begin] + [0] * (len(shape) - 1),
                                      [end] + shape[1:]])
    return regions
