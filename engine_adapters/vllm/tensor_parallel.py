"""Tensor parallelism: the ranks of one vLLM engine agree over vLLM's TP group, so that every
rank is set up or none is, and a commit flips all of them between the same two steps.

vLLM's multiprocess executor ends the engine when a worker raises in a collective_rpc, so under
tensor parallelism a refusal is returned as ``{"refused": message, "error": class name}`` and the
front end (front_end.py) raises it."""

from __future__ import annotations

import functools

# How many times the tensor-parallel ranks agree during init_weight_update_group: once every rank
# checked its part (before any transport connects), once every rank is set up.
SET_UP_ROUNDS = 2


class RefusedOnAnotherRank(Exception):
    """Another tensor-parallel rank refused init_weight_update_group."""


def all_ranks_or_none(set_up):
    """init_weight_update_group under tensor parallelism: every rank is set up or none is, and a
    refusal is returned, not raised (vLLM's multiprocess executor ends the engine when a worker
    raises in a collective_rpc). The set-up calls its `_agree` once everything is checked and
    once it is set up; here that is an all-reduce over vLLM's TP group."""

    @functools.wraps(set_up)
    def init(self, *args, **kwargs):
        if size(self) == 1:
            return set_up(self, *args, **kwargs)
        group_before = self._shadowsync  # an "already initialized" refusal leaves it alone
        rounds_passed = 0

        def agree() -> None:
            nonlocal rounds_passed
            if not on_every_rank(True):
                raise RefusedOnAnotherRank()
            rounds_passed += 1

        def take_back(detail: str) -> str:
            """Closes a group set up here; says so in `detail` if that fails too (never raises:
            a raise here would end vLLM's engine)."""
            try:
                if self._shadowsync is not group_before:
                    self.close_weight_update_group()
            except Exception as close_error:  # noqa: BLE001
                detail += f"; closing the group set up on this rank failed too: {close_error}"
            return detail

        try:
            return set_up(self, *args, _agree=agree, **kwargs)
        except RefusedOnAnotherRank:  # set up here, maybe; another rank refused or failed
            return {"refused": take_back("init_weight_update_group: refused on another "
                                         "tensor-parallel rank (its message says why); nothing "
                                         "was set up on any rank"),
                    "error": "InvalidArgumentError"}
        except Exception as error:  # noqa: BLE001 - returned: a raise here ends vLLM's engine
            detail = take_back(getattr(error, "detail", str(error)))
            # The other ranks wait in the round this rank did not reach; a refusal ends the
            # set-up on every rank, so that round is their last.
            if rounds_passed < SET_UP_ROUNDS:
                try:
                    on_every_rank(False)
                except Exception as agree_error:  # noqa: BLE001
                    detail += f"; telling the other ranks failed too: {agree_error}"
            return {"refused": detail, "error": type(error).__name__}

    return init


def raise_refusal(refusal: dict, message: str) -> None:
    """Raises a refusal a worker returned, as the error class it names (a shadowsync error, else
    a builtin one, else RuntimeError), with `message`."""
    import builtins

    from shadowsync import errors

    name = str(refusal.get("error", ""))
    error = getattr(errors, name, None)
    if isinstance(error, type) and issubclass(error, errors.ShadowsyncError):
        raise error(message)
    error = getattr(builtins, name, None)
    if isinstance(error, type) and issubclass(error, Exception):
        raise error(f"{name}: {message}")
    raise RuntimeError(f"{name}: {message}")


def on_every_rank(flag: bool) -> bool:
    """True when `flag` holds on every rank of vLLM's tensor-parallel group (an all-reduce over
    its CPU group: every worker runs the same collective_rpc, so all of them take part)."""
    import torch
    import torch.distributed as dist
    from vllm.distributed import get_tp_group

    value = torch.tensor([1 if flag else 0], dtype=torch.int32)
    dist.all_reduce(value, op=dist.ReduceOp.MIN, group=get_tp_group().cpu_group)
    return bool(value.item())


def gathered(value) -> tuple[list, int]:
    """`value` of every rank of vLLM's tensor-parallel group, in rank order, and this rank's
    index (an all-gather over its CPU group: every worker runs the same collective_rpc)."""
    import torch.distributed as dist
    from vllm.distributed import get_tp_group

    group = get_tp_group()
    values = [None] * group.world_size
    dist.all_gather_object(values, value, group=group.cpu_group)
    return values, group.rank_in_group


def _parallel_config(worker):
    parallel = getattr(worker, "parallel_config", None)
    if parallel is None:
        parallel = getattr(getattr(worker, "vllm_config", None), "parallel_config", None)
    return parallel


def size(worker) -> int:
    """vLLM's tensor_parallel_size for this worker; 1 when it is not vLLM's."""
    return int(getattr(_parallel_config(worker), "tensor_parallel_size", 1) or 1)


def pipeline_size(worker) -> int:
    """vLLM's pipeline_parallel_size for this worker; 1 when it is not vLLM's."""
    return int(getattr(_parallel_config(worker), "pipeline_parallel_size", 1) or 1)


def front_end_hears_every_worker(worker) -> bool:
    """Whether a collective_rpc of this worker's front end returns every worker's answer: not
    with data_parallel_size > 1 in one engine (vLLM returns the first replica's only) nor with
    the external_launcher executor (each process answers for its own worker). Unknown: False."""
    parallel = _parallel_config(worker)
    if parallel is None:
        return False
    return (int(getattr(parallel, "data_parallel_size", 1) or 1) == 1
            and getattr(parallel, "distributed_executor_backend", None) != "external_launcher")


def rank(worker) -> int:
    """This worker's rank in vLLM's tensor-parallel group; 0 when it is not vLLM's (or alone)."""
    if size(worker) == 1:
        return 0
    from vllm.distributed import get_tp_group

    return int(get_tp_group().rank_in_group)
