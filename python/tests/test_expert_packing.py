"""expert_packing.compose: copies into a tensor as loaded, rewritten into its packed order, must put
every wire element exactly where packing the loaded tensor would. Checked element by element on
small shapes with the two orders vLLM CPU packs experts in (its vector kernels: blocks of 16 rows
transposed; AMX: the same with pairs of columns interleaved), for the copies vLLM's expert loaders
make (whole rows, tensor-parallel slices, unaligned row ranges, a transposing copy). Pure Python:
no torch, no vLLM. The order itself is derived from vLLM's op and checked on the real engine
(test_vllm_real.py, qwen3_moe and mixtral)."""

from __future__ import annotations

import itertools

import pytest

from shadowsync.receive_plan import PlanCopy
from shadowsync.vllm.expert_packing import Digit, PackedOrder, compose_all

EXPERTS, ROWS, COLUMNS, HALF = 2, 64, 16, 32  # one stacked parameter [experts, rows, columns]
SIZE = EXPERTS * ROWS * COLUMNS


def blocked_rows(columns: int) -> PackedOrder:
    """vLLM CPU's vector order: rows in blocks of 16, each block stored column by column."""
    return PackedOrder((Digit(columns, 1, 16), Digit(16, columns, 1),
                        Digit(ROWS // 16, 16 * columns, 16 * columns),
                        Digit(EXPERTS, ROWS * columns, ROWS * columns)))


def blocked_row_pairs(columns: int) -> PackedOrder:
    """vLLM CPU's AMX order for 16-bit weights: as above with pairs of columns kept together."""
    return PackedOrder((Digit(2, 1, 1), Digit(columns // 2, 2, 32), Digit(16, columns, 2),
                        Digit(ROWS // 16, 16 * columns, 16 * columns),
                        Digit(EXPERTS, ROWS * columns, ROWS * columns)))


ORDERS = {"vector": blocked_rows(COLUMNS), "amx": blocked_row_pairs(COLUMNS)}


def run(copies: list[PlanCopy], wire_sizes: dict[str, int]) -> list:
    """The destination after `copies`: each element (wire name, index), None where unwritten;
    an element written twice fails."""
    out: list = [None] * SIZE
    for c in copies:
        assert c.wire in wire_sizes
        for index in itertools.product(*(range(n) for n in c.shape)):
            src = c.src_offset + sum(i * s for i, s in zip(index, c.src_strides))
            dst = c.dst_offset + sum(i * s for i, s in zip(index, c.dst_strides))
            assert 0 <= src < wire_sizes[c.wire]
            assert out[dst] is None, f"element {dst} written twice ({c})"
            out[dst] = (c.wire, src)
    return out


def packed(order: PackedOrder, loaded: list) -> list:
    out: list = [None] * SIZE
    for logical, value in enumerate(loaded):
        out[order.packed_offset(logical)] = value
    return out


def check(order: PackedOrder, copies: list[PlanCopy], wire_sizes: dict[str, int]) -> int:
    loaded = run(copies, wire_sizes)
    assert None not in loaded  # the copies cover the parameter (as the plan requires)
    composed = compose_all(copies, {"w13": order})
    assert run(composed, wire_sizes) == packed(order, loaded)
    return len(composed)


def expert_rows(first_row: int, rows: int, expert: int, wire: str) -> PlanCopy:
    return PlanCopy(wire, "w13", (rows, COLUMNS), 0, (COLUMNS, 1),
                    expert * ROWS * COLUMNS + first_row * COLUMNS, (COLUMNS, 1))


@pytest.mark.parametrize("kind", ORDERS)
def test_the_expert_loaders_copies_land_packed(kind):
    """Per expert, gate into the first half of w13's rows and up into the second: each copy
    stays one copy (its dimensions split along the order's digits)."""
    copies = [expert_rows(half * HALF, HALF, e, f"{name}{e}")
              for e in range(EXPERTS) for half, name in enumerate(("gate", "up"))]
    assert check(ORDERS[kind], copies, {c.wire: HALF * COLUMNS for c in copies}) == len(copies)


@pytest.mark.parametrize("kind", ORDERS)
def test_tensor_parallel_slices_and_unaligned_rows_land_packed(kind):
    """A rank's slice of a wire tensor (a source offset) and row ranges that start and end inside
    a block of 16 (cut at the block's edge, then split along the digits)."""
    copies = [
        PlanCopy("tp_slice", "w13", (40, COLUMNS), 3 * COLUMNS, (COLUMNS, 1), 8 * COLUMNS,
                 (COLUMNS, 1)),
        expert_rows(0, 8, 0, "head"),
        expert_rows(48, 16, 0, "tail"),
        expert_rows(0, ROWS, 1, "expert1"),
    ]
    sizes = {"tp_slice": 43 * COLUMNS, "head": 8 * COLUMNS, "tail": 16 * COLUMNS,
             "expert1": ROWS * COLUMNS}
    assert check(ORDERS[kind], copies, sizes) > len(copies)


@pytest.mark.parametrize("kind", ORDERS)
def test_a_transposing_copy_lands_packed(kind):
    """A wire tensor [columns, rows] transposed into the expert (GPT-2's Conv1D style)."""
    copies = [PlanCopy("t", "w13", (ROWS, COLUMNS), 0, (1, ROWS), 0, (COLUMNS, 1)),
              expert_rows(0, ROWS, 1, "expert1")]
    check(ORDERS[kind], copies, {"t": ROWS * COLUMNS, "expert1": ROWS * COLUMNS})


def test_copies_into_other_parameters_are_left_as_they_are():
    other = PlanCopy("x", "w2", (4, 4), 0, (4, 1), 0, (4, 1))
    assert compose_all([other], {"w13": ORDERS["vector"]}) == [other]


def test_folding_vllms_order_recovers_its_digits():
    """_fold reads the digits back from a permutation (packed position -> loaded index) made
    from known digits; a permutation that is not nested strides is refused, named."""
    torch = pytest.importorskip("torch")
    from shadowsync.errors import LayoutMismatchError
    from shadowsync.vllm.expert_packing import _fold

    order = blocked_row_pairs(COLUMNS)
    one_expert = ROWS * COLUMNS
    source = [None] * one_expert
    for logical in range(one_expert):
        source[order.packed_offset(logical)] = logical
    digits = _fold(torch, torch.tensor(source, dtype=torch.int64), "w13")
    assert sorted(digits, key=lambda d: d.logical) == list(order.digits[:-1])

    shuffled = torch.randperm(one_expert, generator=torch.Generator().manual_seed(0))
    with pytest.raises(LayoutMismatchError, match="'w13'.*not a nested strided reordering"):
        _fold(torch, shuffled, "w13")


@pytest.mark.parametrize("kind", ORDERS)
def test_a_trainer_sending_the_engines_own_tensors_writes_them_packed(kind):
    """packed_in_place_plan: the trainer sends vLLM's own parameters (its stacked experts as
    loaded): each is copied whole, the packed one into its packed order; nothing packed, no
    plan (the receive stays zero-copy)."""
    import shadowsync as ss
    from shadowsync.vllm.receive_planning import packed_in_place_plan

    layout = ss.Layout([("norm", "fp32", (COLUMNS,)), ("w13", "fp32", (EXPERTS, ROWS, COLUMNS))])
    plan = packed_in_place_plan(layout, {"w13": ORDERS[kind]})
    assert plan.wire is layout
    norm = [c for c in plan.copies if c.engine == "norm"]
    assert norm == [PlanCopy("norm", "norm", (COLUMNS,), 0, (1,), 0, (1,))]
    experts = [c for c in plan.copies if c.engine == "w13"]
    # Element i of the trainer's w13 lands where packing the loaded tensor puts element i.
    assert run(experts, {"w13": SIZE}) == packed(ORDERS[kind], [("w13", i) for i in range(SIZE)])
    assert packed_in_place_plan(layout, {"other": ORDERS[kind]}) is None
