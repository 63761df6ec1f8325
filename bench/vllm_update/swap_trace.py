"""--trace-steps: reading vLLM's traced forward calls (bench/vllm_step_trace.py) around a swap.
Each row: [host s since the swap's start, host ms in the call, GPU ms of its forward, GPU ms
before it, the version after it]."""

from __future__ import annotations

import statistics


def swap_row(rows: list) -> int | None:
    """--trace-steps: the index of the traced call the swap ran in (rows' times are relative to
    the swap's start), or None."""
    # The last call that began before the swap: the swap ran in it (the step hook before its
    # forward) or right after its forward was launched (a gated swap, from the step's
    # post_forward), and that call's GPU time holds the stop either way.
    return max((i for i, r in enumerate(rows) if r[0] <= 0), default=None)


def swap_gpu_excess(rows: list) -> float | None:
    """--trace-steps: how much longer the GPU took for the step the swap ran in than the median
    traced step around it (CUDA events, start of execute_model to the end of its forward): the
    GPU's stop for the swap, seen from the GPU. None when no traced call contains the swap."""
    at = swap_row(rows)
    others = [r[2] for i, r in enumerate(rows) if i != at and r[2] is not None]
    if at is None or not others or rows[at][2] is None:  # no GPU (vLLM CPU): host times only
        return None
    return round(rows[at][2] - statistics.median(others), 3)


def trace_line(rows: list) -> str:
    """--trace-steps: the forward calls from 3 before the swap's to 5 after it, each as
    host ms since the previous call's start / host ms in the call / GPU ms start→end of its
    forward / GPU ms from the previous forward's end to its start, and the version after it."""
    at = swap_row(rows)
    if at is None:
        return f"trace: no traced call contains the swap ({len(rows)} calls traced)"
    cells = []
    for i in range(max(0, at - 3), min(len(rows), at + 6)):
        began, took, gpu, before, version = rows[i]
        since = f"{(began - rows[i - 1][0]) * 1e3:.2f}" if i > 0 else "-"
        mark = "*" if i == at else ""
        gpu_text = "-" if gpu is None else f"{gpu:.2f}"
        cells.append(f"{mark}{since}/{took:.2f}/{gpu_text}/{'-' if before is None else f'{before:.2f}'} v{version}")
    return "trace (ms: since previous call / in the call / GPU call / GPU before; * the swap): " + \
        " | ".join(cells)
