"""shadowsync.vllm fed by a sharded trainer (ShadowsyncInitInfo.trainer_ranks), on a fake vLLM
worker whose "parameters" are numpy arrays (host backend; no torch, no vLLM): two trainer ranks,
each holding part of every tensor (rows, columns, flat elements), serve the same-host pull
transport from threads; the worker answers weight_update_needs, builds the same routing plan from
their regions and its needs, connects and takes two updates, each only from the ranks that hold
the bytes. Then every refusal of a bad set-up, named, with nothing set up. (The needs themselves,
shadowsync.needed_ranges, are tested in test_routing.py.)"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from types import SimpleNamespace

import numpy as np
import pytest
from support import DEADLINE_S, SPECS, pattern

import shadowsync as ss
from shadowsync import TensorRegion
from shadowsync.vllm import WorkerExtension, weight_update_needs
from shadowsync.vllm.init_info import region_data

TOKEN = "ssk1-5b0b1f0e3c7a4d2e9f8a6b5c4d3e2f1a0b9c8d7e6f5a4b3c2d1e0f9a8b7c6d5e"
BUCKET_BYTES = 1024
M = 2

# What each trainer rank holds: embed by rows (FSDP2 Shard(0)), w as flat elements (ZeRO-3),
# lora.A by columns (Shard(1)); norm and lora.B whole on one rank.
REGIONS = [
    [TensorRegion.box("embed", (0, 0), (150, 4)), TensorRegion.elements("w", 0, 100),
     TensorRegion.box("lora.A", (0, 0), (16, 4)), TensorRegion.whole("lora.B", (8, 16))],
    [TensorRegion.box("embed", (150, 0), (300, 4)), TensorRegion.elements("w", 100, 157),
     TensorRegion.whole("norm", (7,)), TensorRegion.box("lora.A", (0, 4), (16, 8))],
]


class Param:
    def __init__(self, data):
        self.data = data


class FakeWorker(WorkerExtension):
    """model_runner.model with named_parameters() and an execute_model, as vLLM's worker."""

    def __init__(self):
        params = [(s[0], Param(pattern(s[0], 0))) for s in SPECS]
        self.model_runner = SimpleNamespace(model=SimpleNamespace(
            named_parameters=lambda: iter(params)))
        self.params = dict(params)

    def execute_model(self, batch):
        return batch


class FrontEnd:
    """vLLM's LLM as far as the front end's calls go: collective_rpc on one worker."""

    def __init__(self, worker):
        self.worker = worker

    def collective_rpc(self, method, args=(), kwargs=None):
        return [getattr(self.worker, method)(*args, **(kwargs or {}))]


def shard(array: np.ndarray, region: TensorRegion) -> np.ndarray:
    if region.kind == "elements":
        return array.reshape(-1)[region.first:region.first + region.count].copy()
    return np.ascontiguousarray(array[tuple(slice(b, e) for b, e in zip(region.begin,
                                                                          region.end))])


@pytest.fixture
def paths():
    directory = tempfile.mkdtemp(prefix="ss_ranks_")  # mode 0700, as the transport requires
    yield [os.path.join(directory, f"trainer{t}.sock") for t in range(M)]
    shutil.rmtree(directory, ignore_errors=True)


def trainer_ranks(paths, regions=REGIONS, **extra) -> dict:
    return dict(count=len(regions), paths=paths[:len(regions)], token=TOKEN,
                regions=[[region_data(r) for r in rank] for rank in regions],
                connect_timeout_ms=int(DEADLINE_S * 1000), **extra)


def info(paths, **extra) -> dict:
    return dict(specs=SPECS, bucket_bytes=BUCKET_BYTES, trainer_ranks=trainer_ranks(paths, **extra))


@pytest.mark.parametrize("replicas", [1, 2])
def test_two_trainer_ranks_update_a_worker_each_sending_only_its_shards(paths, replicas):
    """With 2 replicas, two workers (two vLLM engine instances, trainer_ranks.replica 0 and 1)
    take every update from trainer ranks that publish it once."""
    workers = [FakeWorker() for _ in range(replicas)]
    llm = FrontEnd(workers[0])
    needs = weight_update_needs(llm, info(paths))
    assert workers[0].weight_update_needs(info(paths))["engine_rank"] == 0
    layout = ss.Layout(SPECS, bucket_bytes=BUCKET_BYTES)
    # No receive plan (the trainer sends the engine's own tensors): every tensor is needed.
    assert needs == [[[t.group_index, t.offset, t.offset + t.bytes]
                      for g in layout.groups for t in g.tensors]]
    plan = ss.RoutingPlan(layout, REGIONS, [[ss.WireRange(*r) for r in needs[0]]])
    served = {}

    def serve(rank):
        try:
            served[rank] = ss.same_host_pull_trainer_transport(
                paths[rank], TOKEN, plan, rank, replicas, ss.HostBackend(),
                connect_timeout_ms=int(DEADLINE_S * 1000))
        except ss.ShadowsyncError as error:
            served[rank] = error

    threads = [threading.Thread(target=serve, args=(rank,)) for rank in range(M)]
    for thread in threads:
        thread.start()
    for replica, worker in enumerate(workers):
        extra = {"replica": replica} if replica else {}
        fingerprint = worker.init_weight_update_group(
            info(paths, engine_needs=needs, fingerprint=plan.fingerprint, **extra))
        assert fingerprint == layout.fingerprint
    for thread in threads:
        thread.join()
    backend = ss.HostBackend()
    senders = [ss.Sender(layout, backend, served[rank], routing_plan=plan, trainer_rank=rank)
               for rank in range(M)]
    try:
        for version in (1, 2):
            full = {s[0]: pattern(s[0], version) for s in SPECS}
            handles = [senders[rank].publish_shards(
                version, [(r.tensor, shard(full[r.tensor], r), r) for r in REGIONS[rank]])
                for rank in range(M)]
            for worker in workers:
                assert worker.begin_update(handles[0].header_bytes) == version
            for handle in handles:
                handle.wait(DEADLINE_S)
            for replica, worker in enumerate(workers):
                assert worker.wait_applied(version, DEADLINE_S) == version
                for name, values in full.items():
                    np.testing.assert_array_equal(worker.params[name].data, values,
                                                  err_msg=f"replica {replica}")
                stats = worker.weight_update_stats()
                assert stats["routed_bytes"] == plan.bytes_to_engine(0) == sum(
                    t.bytes for g in layout.groups for t in g.tensors)
                assert stats["trainer_count"] == M
                assert stats["routing_fingerprint"] == plan.fingerprint
                assert stats["updates_failed"] == 0
    finally:
        for worker in workers:
            worker.close_weight_update_group()
        for sender in senders:
            sender.close()


def refused(paths, error=ss.InvalidArgumentError, **fields) -> str:
    """init_weight_update_group with `fields` over info(): the refusal's text; nothing set up."""
    worker = FakeWorker()
    with pytest.raises(error) as caught:
        worker.init_weight_update_group(fields.pop("whole", None) or info(paths, **fields))
    assert not worker.has_weight_update_group()
    np.testing.assert_array_equal(worker.params["embed"].data, pattern("embed", 0))
    return str(caught.value)


def test_bad_set_ups_are_refused_by_name_before_anything_connects(paths):
    layout = ss.Layout(SPECS, bucket_bytes=BUCKET_BYTES)
    needs = weight_update_needs(FrontEnd(FakeWorker()), info(paths))
    fingerprint = ss.RoutingPlan(layout, REGIONS, [[ss.WireRange(*r) for r in needs[0]]]
                                 ).fingerprint
    good = dict(engine_needs=needs, fingerprint=fingerprint)

    message = refused(paths, ss.LayoutMismatchError, engine_needs=needs,
                      fingerprint=fingerprint ^ 1)
    assert (f"init_weight_update_group: trainer_ranks: this engine rank's routing plan "
            f"(fingerprint {fingerprint:#018x}, 2 trainer ranks -> 1 engine ranks") in message, \
        message
    assert f"differs from the trainers' ({fingerprint ^ 1:#018x})" in message, message
    message = refused(paths, engine_needs=needs * 2, fingerprint=fingerprint)
    assert "engine_needs holds the needs of 2 engine rank(s), but this engine has 1" in message
    assert "the world size differs" in message
    message = refused(paths, engine_needs=[needs[0][1:]], fingerprint=fingerprint)
    assert "engine_needs[0] (" in message and "is not what engine rank 0's receive plan reads" \
        in message, message
    assert "engine_needs and fingerprint missing; call weight_update_needs" in refused(paths)
    # Two ranks holding the same rows of embed.
    overlap = [REGIONS[0] + [TensorRegion.box("embed", (149, 0), (151, 4))], REGIONS[1]]
    message = refused(paths, regions=overlap, **good)
    assert "the routing plan is refused: " in message, message
    assert "trainer ranks 0 and 1 both hold bytes 2400..2416 of tensor 'embed'" in message
    # Nobody holds norm.
    nobody = [REGIONS[0], [r for r in REGIONS[1] if r.tensor != "norm"]]
    message = refused(paths, regions=nobody, **good)
    assert "the routing plan is refused: " in message, message
    assert "engine rank 0 needs bytes 0..14 of tensor 'norm' (group 'base'), which no trainer " \
           "rank holds" in message, message
    # A rank missing: two paths, the regions of one rank.
    whole = info(paths, **good)
    whole["trainer_ranks"]["regions"] = whole["trainer_ranks"]["regions"][:1]
    message = refused(paths, whole=whole)
    assert "count is 2, but regions has 1 entries" in message and "a rank missing" in message
    # trainer_ranks is a transport of its own.
    whole = info(paths, **good)
    whole["same_host"] = dict(path=paths[0], token=TOKEN)
    assert "trainer_ranks and same_host are both set" in refused(paths, whole=whole)
    # A bad region, named by its place.
    whole = info(paths, **good)
    whole["trainer_ranks"]["regions"][1][0] = ["embed", "box", [0], [5, 4]]
    assert "trainer_ranks.regions[1][0]: region of tensor 'embed': begin has 1 dimensions" in \
        refused(paths, whole=whole)
    # A replica index below 0.
    assert "trainer_ranks.replica" in refused(paths, replica=-1, **good)
    # Routed updates carry no checksums yet.
    whole = info(paths, **good)
    whole["receiver_config"] = ss.ReceiverConfig(require_checksums=True)
    assert "routed updates carry no checksums yet" in refused(paths, whole=whole)


def nccl_info(paths, nccl, **extra) -> dict:
    """info() with the trainer ranks on NCCL point-to-point instead of the same-host pull."""
    whole = info(paths, **extra)
    ranks = whole["trainer_ranks"]
    del ranks["paths"], ranks["token"]
    ranks["nccl"] = nccl
    return whole


def test_nccl_routes_are_refused_by_name_where_they_cannot_run(paths):
    layout = ss.Layout(SPECS, bucket_bytes=BUCKET_BYTES)
    needs = weight_update_needs(FrontEnd(FakeWorker()), info(paths))
    plan = ss.RoutingPlan(layout, REGIONS, [[ss.WireRange(*r) for r in needs[0]]])
    good = dict(engine_needs=needs, fingerprint=plan.fingerprint)
    gpus = ["host/GPU-0", "host/GPU-1", "host/GPU-2"]
    nccl = dict(unique_id=bytes(range(128)), gpus=gpus)
    # One transport or the other.
    whole = nccl_info(paths, nccl, **good)
    whole["trainer_ranks"]["token"] = TOKEN
    assert "'nccl' and ['token'] are both set; the trainer ranks send over one transport" in \
        refused(paths, whole=whole)
    # A replica the communicator does not hold: without 'replicas' it holds one.
    assert "trainer_ranks.replica is 1, but trainer_ranks.nccl.replicas is 1 (replicas 0..0 " \
           "join" in refused(paths, whole=nccl_info(paths, nccl, replica=1, **good))
    assert "trainer_ranks.replica is 2, but trainer_ranks.nccl.replicas is 2" in \
        refused(paths, whole=nccl_info(paths, dict(nccl, replicas=2, gpus=gpus + ["host/GPU-3"]),
                                       replica=2, **good))
    message = refused(paths, whole=nccl_info(paths, dict(nccl, replicas=0), **good))
    assert "trainer_ranks.nccl.replicas" in message and "0" in message, message
    # Every communicator rank's GPU named: 2 trainer ranks and the engine's.
    message = refused(paths, whole=nccl_info(paths, dict(nccl, gpus=gpus[:2]), **good))
    assert "trainer_ranks.nccl.gpus holds 2 names, but 2 trainer ranks and at least one engine " \
           "rank need more" in message, message
    message = refused(paths, whole=nccl_info(paths, dict(nccl, unique_id=b"short"), **good))
    assert "the 128 bytes of shadowsync.nccl_unique_id()" in message, message
    # A worker on the CPU: NCCL routes need GPU workers (after planning, before anything joins).
    message = refused(paths, whole=nccl_info(paths, nccl, **good))
    assert "trainer_ranks.nccl: NCCL routes need GPU workers, and this engine runs on the CPU; " \
           "give the trainer ranks' 'paths' and 'token'" in message, message


def test_an_nccl_routed_transport_names_a_gpu_list_of_another_size():
    layout = ss.Layout(SPECS, bucket_bytes=BUCKET_BYTES)
    plan = ss.RoutingPlan(layout, REGIONS, [[ss.WireRange(t.group_index, t.offset,
                                                          t.offset + t.bytes)
                                             for g in layout.groups for t in g.tensors]])
    with pytest.raises(ss.InvalidArgumentError) as caught:
        ss.nccl_routed_transport(bytes(128), plan, 0, 0, ss.HostBackend(), ["a", "b"])
    assert "gpus holds 2 names, but the plan's communicator has 3 ranks (2 trainer and 1 " \
           "engine ranks): name the GPU of every rank, trainer ranks first" in str(caught.value)
    with pytest.raises(ss.InvalidArgumentError) as caught:
        ss.nccl_routed_transport(bytes(128), plan, 3, 0, ss.HostBackend(), ["a", "b", "c"])
    assert "nccl_routed_transport(rank=3, device=0): rank is 3, expected 0..2" in \
        str(caught.value), str(caught.value)
    # With engine replicas the communicator holds every replica's engine ranks.
    with pytest.raises(ss.InvalidArgumentError) as caught:
        ss.nccl_routed_transport(bytes(128), plan, 3, 0, ss.HostBackend(), ["a", "b", "c"],
                                 replicas=2)
    assert "gpus holds 3 names, but the plan's communicator has 4 ranks (2 trainer and 1 " \
           "engine ranks in each of 2 replicas)" in str(caught.value), str(caught.value)
    with pytest.raises(ss.InvalidArgumentError) as caught:
        ss.nccl_routed_transport(bytes(128), plan, 0, 0, ss.HostBackend(), ["a", "b", "c"],
                                 replicas=0)
    assert "replicas is 0, expected 1..65536" in str(caught.value), str(caught.value)
    # NCCL moves device memory: a host backend is refused (a library without CUDA refuses it all).
    error = ss.InvalidArgumentError if ss.has_cuda() else ss.NotSupportedError
    with pytest.raises(error) as caught:
        ss.nccl_routed_transport(bytes(128), plan, 0, 0, ss.HostBackend(), ["a", "b", "c"])
    if ss.has_cuda():
        assert "backend 'host' given; NCCL moves device memory: give the CUDA backend of " \
               "device 0" in str(caught.value), str(caught.value)
