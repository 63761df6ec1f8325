"""ShardedPublisher with real FSDP2: two gloo trainer ranks on CPU, this process the engine.

Each rank builds the same seeded module, shards it with fully_shard (a Linear of 13 output rows:
uneven Shard(0); one weight Shard(1) through shard_placement_fn) and sets up a ShardedPublisher;
this process takes rank 0's engine_setup and connects a Receiver (HostBackend, pull transport
to both ranks' paths, the routing plan in use). Updates 1 and 2 follow an SGD step each on both
ranks, published inside forbid_gathers() (where full_tensor and all_gather_into_tensor raise:
the positive control): the live tensors equal the same module stepped the same way without
sharding, and the routes carried exactly the plan's bytes. Update 3: trainer rank 1 SIGKILLs
itself once the engine has begun the update (rank 0 has published): the update fails on the
engine naming trainer rank 1, rank 0's publish fails, and the live tensors stay update 2's.
Before all that, the set-up refusals (parameters that differ between ranks; engine replicas
that differ; a DTensor mesh larger than the process group) raise on every rank. And one trainer
process without torch.distributed publishes as rank 0 of 1.
"""

from __future__ import annotations

import os
import queue
import shutil
import signal
import sys
import tempfile
import time
import traceback

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import shadowsync as ss  # noqa: E402
from shadowsync.sharded_publisher import sharded_receiver  # noqa: E402

WORLD = 2
TOKEN = "ssk1-5f0c6f3a9d2be4817c0a6b2d9e1f4c7a3b8d0e5f2a6c9b1d4e7f0a3c6b9d2e51"
DEADLINE_S = 30
STEPS = 2  # good updates; update STEPS + 1 loses trainer rank 1


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 13), torch.nn.ReLU(),  # weight [13, 8], bias [13]: 7 + 6 rows
        torch.nn.Linear(13, 6), torch.nn.ReLU(),
        torch.nn.Linear(6, 8))  # weight [8, 6]: Shard(1), 3 + 3 columns


def _shard_placement(param):
    from torch.distributed.tensor import Shard

    return Shard(1) if tuple(param.shape) == (8, 6) else None


def _step(model, optimizer, step):
    """One training step: the same input on every rank (and the reference), so that FSDP2's
    averaged gradient is the single-process gradient, bit for bit."""
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
    optimizer.zero_grad()
    model(x).square().mean().backward()
    optimizer.step()


def _trainer(rank, store, paths, to_engine, kill_rank1):
    status = 0
    try:
        _train(rank, store, paths, to_engine, kill_rank1)
    except BaseException:
        traceback.print_exc()
        status = 1
    # os._exit skips the queue's feeder thread: without this join, a message put just before
    # (rank 0's "rank 0 failed") may never reach the engine, which then waits out its deadline.
    to_engine.close()
    to_engine.join_thread()
    sys.stdout.flush()
    sys.stderr.flush()
    # As test_sharding_torch: torch keeps gloo's threads alive past destroy_process_group once a
    # DTensor exists, and the interpreter's exit may abort on them. Everything was checked.
    os._exit(status)


def _train(rank, store, paths, to_engine, kill_rank1):
    from datetime import timedelta

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from shadowsync.sharding import GatherForbidden, forbid_gathers

    dist.init_process_group("gloo", store=dist.FileStore(store, WORLD), rank=rank,
                            world_size=WORLD, timeout=timedelta(seconds=DEADLINE_S))
    mesh = init_device_mesh("cpu", (WORLD,))
    model = _model()
    fully_shard(model, mesh=mesh, shard_placement_fn=_shard_placement)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    # Refused at set-up, on every rank, naming the first difference / both sizes.
    named = list(model.named_parameters())
    if rank == 1:
        named[2] = ("2.w", named[2][1])
    with pytest.raises(ss.InvalidArgumentError) as refused:
        ss.ShardedPublisher.set_up(named, path=paths[rank], token=TOKEN)
    other = 1 - rank
    assert (f"trainer rank {rank}: the parameters differ from trainer rank {other}'s: parameter "
            f"2 is '{'2.weight' if rank == 0 else '2.w'}' fp32 [6, 13] on this rank and "
            f"'{'2.w' if rank == 0 else '2.weight'}' fp32 [6, 13] there") in str(refused.value)
    with pytest.raises(ss.InvalidArgumentError) as refused:
        ss.ShardedPublisher.set_up(model.named_parameters(), path=paths[rank], token=TOKEN,
                                   engine_replicas=1 + rank)
    assert (f"trainer rank {rank}: engine_replicas is {1 + rank} here and {2 - rank} on trainer "
            f"rank {other}") in str(refused.value)
    alone = [dist.new_group([r]) for r in range(WORLD)][rank]
    with pytest.raises(ss.InvalidArgumentError, match=r"parameter '0.weight': its DTensor mesh "
                       r"has 2 ranks \(shape \[2\]\), the process group 1"):
        ss.ShardedPublisher.set_up(model.named_parameters(), path=paths[rank], token=TOKEN,
                                   process_group=alone)

    publisher = ss.ShardedPublisher.set_up(model.named_parameters(), path=paths[rank],
                                           token=TOKEN, bucket_bytes=256,
                                           connect_timeout_ms=DEADLINE_S * 1000)
    if rank == 0:
        to_engine.put(("setup", publisher.engine_setup))
    local_bytes = sum(p._local_tensor.nbytes for p in model.parameters())
    to_engine.put(("memory", rank, publisher.staging_bytes, publisher.held_bytes,
                   publisher.sent_bytes, local_bytes))

    for step in range(1, STEPS + 2):
        _step(model, optimizer, step)
        if step == STEPS + 1 and rank == 1:
            kill_rank1.get(timeout=DEADLINE_S)  # the engine has begun update 3
            os.kill(os.getpid(), signal.SIGKILL)
        with forbid_gathers():
            if step == 1:  # positive control: the guard is armed here
                with pytest.raises(GatherForbidden, match="full_tensor"):
                    model[0].weight.full_tensor()
                with pytest.raises(GatherForbidden, match="all_gather_into_tensor"):
                    dist.all_gather_into_tensor(torch.empty(2), torch.ones(1))
            handle = publisher.publish(step, model.named_parameters())
            if rank == 0:
                to_engine.put(("header", step, handle.header_bytes))
            if step <= STEPS:
                handle.wait(DEADLINE_S)
            else:  # rank 1 died mid-update: the engine aborted, and so does this publish
                with pytest.raises(ss.ShadowsyncError) as failed:
                    handle.wait(DEADLINE_S)
                to_engine.put(("rank 0 failed", str(failed.value)))
    publisher.close()


class _Mailbox:
    """The trainer ranks' messages by kind (the two ranks' puts interleave); a rank that failed
    (its traceback is on stderr) fails the wait at once, not at the deadline."""

    def __init__(self, channel, ranks):
        self.channel, self.ranks, self.held = channel, ranks, []
        self.killed = set()  # ranks whose SIGKILL is the test's

    def get(self, kind):
        deadline = time.monotonic() + DEADLINE_S
        while True:
            for i, message in enumerate(self.held):
                if message[0] == kind:
                    return self.held.pop(i)[1:]
            failed = [(r, p.exitcode) for r, p in enumerate(self.ranks)
                      if p.exitcode not in (None, 0) and r not in self.killed]
            assert not failed, f"waiting for '{kind}': trainer ranks failed (rank, exit code): " \
                               f"{failed}; their tracebacks are on stderr"
            assert time.monotonic() < deadline, \
                f"no '{kind}' from the trainer ranks within {DEADLINE_S} s; got {self.held}"
            try:
                self.held.append(self.channel.get(timeout=0.5))
            except queue.Empty:
                pass


def test_fsdp2_ranks_publish_their_shards_into_a_receiver(tmp_path):
    directory = tempfile.mkdtemp(prefix="ss_fsdp2_")  # short (socket paths), mode 0700
    paths = [os.path.join(directory, f"rank{r}.sock") for r in range(WORLD)]
    context = mp.get_context("spawn")
    to_engine, kill_rank1 = context.Queue(), context.Queue()
    ranks = [context.Process(target=_trainer, daemon=True,
                             args=(r, str(tmp_path / "store"), paths, to_engine, kill_rank1))
             for r in range(WORLD)]
    for process in ranks:
        process.start()
    mail, receiver = _Mailbox(to_engine, ranks), None
    try:
        (setup,) = mail.get("setup")
        receiver = sharded_receiver(setup, TOKEN, 0, connect_timeout_ms=DEADLINE_S * 1000)
        plan = receiver.routing_plan
        memory = sorted(mail.get("memory") for _ in range(WORLD))
        for rank, staging, held, sent, local in memory:
            print(f"trainer rank {rank}: packing {staging} bytes for {local} parameter bytes held "
                  f"({sent} sent per update)")
            assert staging == 2 * plan.max_packed_bytes(rank)
            assert held == local == sent == plan.bytes_from_trainer(rank)
        assert sum(m[4] for m in memory) == plan.bytes_to_engine(0)

        reference = _model()
        optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
        for step in range(1, STEPS + 1):
            _step(reference, optimizer, step)
            version, header = mail.get("header")
            assert version == step
            receiver.begin_update(header)
            receiver.wait_applied(step, DEADLINE_S)
            for name, param in reference.named_parameters():
                assert torch.equal(torch.from_numpy(receiver.live_array(name).copy()),
                                   param.detach()), (step, name)
            stats = receiver.stats()
            assert stats.routed_bytes == plan.bytes_to_engine(0), stats
            assert (stats.trainer_count, stats.routing_fingerprint) == (2, plan.fingerprint)

        version, header = mail.get("header")
        assert version == STEPS + 1
        receiver.begin_update(header)
        mail.killed.add(1)
        kill_rank1.put("die")
        receiver.drain()  # the update in flight fails once trainer rank 1's socket closes
        stats = receiver.stats()
        assert (stats.updates_failed, stats.applied_version) == (1, STEPS), stats
        assert "trainer rank 1" in receiver.last_update_error(), receiver.last_update_error()
        assert receiver.before_step() is None
        for name, param in reference.named_parameters():  # still update 2's
            assert torch.equal(torch.from_numpy(receiver.live_array(name).copy()), param.detach())
        (rank0_error,) = mail.get("rank 0 failed")
        print(f"engine: {receiver.last_update_error()}\ntrainer rank 0: {rank0_error}")

        for process in ranks:
            process.join(DEADLINE_S)
        assert [p.exitcode for p in ranks] == [0, -signal.SIGKILL]
    finally:
        if receiver is not None:
            receiver.close()
        for process in ranks:
            if process.is_alive():
                process.kill()
                process.join(DEADLINE_S)
        shutil.rmtree(directory, ignore_errors=True)


def test_one_trainer_process_without_torch_distributed_publishes_as_rank_0_of_1(tmp_path):
    """A single trainer process, no process group: ShardedPublisher is rank 0 of 1 (no
    collective) and its whole tensors reach a Receiver; host memory goes through the staging,
    and the publisher says so."""
    assert not dist.is_initialized()  # this process never joins a group
    directory = tempfile.mkdtemp(prefix="ss_one_")
    model = _model()
    publisher = receiver = None
    try:
        publisher = ss.ShardedPublisher.set_up(model.named_parameters(),
                                               path=os.path.join(directory, "rank0.sock"),
                                               token=TOKEN)
        assert (publisher.rank, publisher.world_size) == (0, 1)
        assert publisher.routes_in_place == (None, "")
        receiver = sharded_receiver(publisher.engine_setup, TOKEN, 0,
                                    connect_timeout_ms=DEADLINE_S * 1000)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in (1, 2):
            _step(model, optimizer, step)
            handle = publisher.publish(step, model.named_parameters())
            receiver.begin_update(handle.header_bytes)
            handle.wait(DEADLINE_S)
            receiver.wait_applied(step, DEADLINE_S)
            for name, param in model.named_parameters():
                assert torch.equal(torch.from_numpy(receiver.live_array(name).copy()),
                                   param.detach()), (step, name)
        assert receiver.stats().routed_bytes == receiver.routing_plan.bytes_to_engine(0)
        assert publisher.routes_in_place == (
            False, 'host memory (memory="host") is read from the staging slots')
        # A process group given without torch.distributed is refused, naming what to do.
        with pytest.raises(ss.InvalidArgumentError, match="call init_process_group"):
            ss.ShardedPublisher.set_up(model.named_parameters(), token=TOKEN,
                                       path=os.path.join(directory, "other.sock"),
                                       process_group=object())
    finally:
        if receiver is not None:
            receiver.close()
        if publisher is not None:
            publisher.close()
        shutil.rmtree(directory, ignore_errors=True)


class _JoinCalled(Exception):
    """What the stand-in for nccl_routed_transport raises: the call's arguments."""


def test_nccl_routes_set_up_hands_every_rank_and_engine_the_same_communicator(monkeypatch):
    """ShardedPublisher with engine_gpus (NCCL routes), as far as a machine without a GPU goes:
    the refusals, then, with NCCL's calls stood in for, the communicator each side would join
    (rank, every rank's GPU in order, the replicas) and what engine_setup hands the engines
    (sharded_receiver, and vLLM's from_engine_setup)."""
    import base64

    from shadowsync import sharded_publisher as sp

    model = _model()
    # Refused before anything joins.
    with pytest.raises(ss.InvalidArgumentError, match="give path and token .* or engine_gpus"):
        ss.ShardedPublisher.set_up(model.named_parameters())
    with pytest.raises(ss.InvalidArgumentError, match="are both given; the trainer ranks serve "
                                                      "one transport"):
        ss.ShardedPublisher.set_up(model.named_parameters(), path="/tmp/x.sock", token=TOKEN,
                                   engine_gpus=["h/GPU-1"])
    with pytest.raises(ss.InvalidArgumentError,
                       match="needs this rank's shards on a GPU, and they are in host memory"):
        ss.ShardedPublisher.set_up(model.named_parameters(), engine_gpus=["h/GPU-1"])

    # A CUDA backend of device 3 that needs no GPU (nothing here runs on it).
    class Device3(ss.CudaBackend):
        def __init__(self):
            self._handle, self._closed = None, True
            self.device_index, self.device = 3, "cuda:3"

    joins = []

    def join(unique_id, plan, rank, device, backend, gpus, config=None, replicas=1):
        joins.append(dict(unique_id=unique_id, rank=rank, device=device, gpus=list(gpus),
                          replicas=replicas, trainers=plan.trainer_count,
                          engines=plan.engine_count))
        raise _JoinCalled()

    unique_id = bytes(range(128))
    monkeypatch.setattr(sp._transport, "gpu_name", lambda device: f"h/GPU-{device}")
    monkeypatch.setattr(sp._transport, "nccl_unique_id", lambda: unique_id)
    monkeypatch.setattr(sp._transport, "nccl_routed_transport", join)
    engine_gpus = ["h/GPU-4", "h/GPU-5"]  # one engine rank in each of 2 replicas
    with pytest.raises(ss.InvalidArgumentError, match="engine_gpus holds 1 names, but 2 engine "
                                                      "replica\\(s\\) x 1 engine ranks are 2"):
        ss.ShardedPublisher.set_up(model.named_parameters(), engine_gpus=engine_gpus[:1],
                                   backend=Device3(), engine_replicas=2)
    publisher = ss.ShardedPublisher.set_up(model.named_parameters(), engine_gpus=engine_gpus,
                                           backend=Device3(), engine_replicas=2)
    # The rank joined (on its serving thread) as communicator rank 0 of 1 + 2 x 1.
    with pytest.raises(_JoinCalled):
        publisher.wait_for_engines(DEADLINE_S)
    assert joins.pop() == dict(unique_id=unique_id, rank=0, device=3,
                               gpus=["h/GPU-3"] + engine_gpus, replicas=2, trainers=1, engines=1)
    setup = publisher.engine_setup
    assert setup["paths"] == []
    assert setup["nccl"] == {"unique_id": base64.b64encode(unique_id).decode("ascii"),
                             "gpus": ["h/GPU-3"] + engine_gpus, "replicas": 2}
    # The engine rank of replica 1 joins as communicator rank 1 + 1 x 1 + 0.
    with pytest.raises(_JoinCalled):
        sharded_receiver(setup, None, 0, backend=Device3(), replica=1)
    assert joins.pop() == dict(unique_id=unique_id, rank=2, device=3,
                               gpus=["h/GPU-3"] + engine_gpus, replicas=2, trainers=1, engines=1)
    with pytest.raises(ss.InvalidArgumentError, match="give backend=CudaBackend"):
        sharded_receiver(setup, None, 0, replica=1)
    # vLLM's workers take the same communicator from the same setup.
    pytest.importorskip("vllm")
    from shadowsync.vllm.trainer_ranks import from_engine_setup

    ranks = from_engine_setup(setup, replica=1)
    assert ranks["nccl"] == setup["nccl"] and ranks["replica"] == 1 and ranks["count"] == 1
    assert "paths" not in ranks and "token" not in ranks
    with pytest.raises(ss.InvalidArgumentError, match="takes no token"):
        from_engine_setup(setup, TOKEN)
