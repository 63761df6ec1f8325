"""ReceiverConfig.swap_strategy through the Python package: copy_in on the host backend
keeps the live storage where it is; the config refusals reach Python as InvalidArgumentError."""

import numpy as np
import pytest
from support import BASE, BUCKET_BYTES, DEADLINE_S, LORA, SPECS, tensors, version_of
from test_vllm_extension import FakeWorker, _step_until, _trainer

import shadowsync as ss


def _receiver(config, transport=None):
    layout = ss.Layout(SPECS, bucket_bytes=BUCKET_BYTES)
    return layout, ss.Receiver(layout, ss.HostBackend(), transport, config)


def test_copy_in_keeps_live_pointers_and_lands_every_version():
    layout = ss.Layout(SPECS, bucket_bytes=BUCKET_BYTES)
    backend = ss.HostBackend()
    loopback = ss.Loopback(2)
    config = ss.ReceiverConfig(update_deadline_ms=int(DEADLINE_S * 1000), swap_strategy="copy_in",
                               engine_uses_cuda_graphs=True)
    receiver = ss.Receiver(layout, backend, loopback.transport(1), config)
    sender = ss.Sender(layout, backend, loopback.transport(0))
    try:
        pointers = {s[0]: receiver.live_pointer(s[0]) for s in SPECS}
        for version, names in [(1, BASE + LORA), (2, LORA), (3, BASE)]:
            handle = sender.publish(version, tensors(names, version))
            receiver.begin_update(handle.header_bytes)
            receiver.wait_applied(version, DEADLINE_S)
            handle.wait(DEADLINE_S)
            receiver.engine_stream.synchronize()  # the copy runs on the engine stream
            assert {s[0]: receiver.live_pointer(s[0]) for s in SPECS} == pointers
        live = {s[0]: version_of(s[0], receiver.live_array(s[0])) for s in SPECS}
        assert live == {"embed": 3, "w": 3, "norm": 3, "lora.A": 2, "lora.B": 2}
    finally:
        receiver.close()
        sender.close()


def test_rebind_with_cuda_graphs_is_refused():
    with pytest.raises(ss.InvalidArgumentError,
                       match="swap_strategy is rebind.*engine_uses_cuda_graphs is true"):
        _receiver(ss.ReceiverConfig(engine_uses_cuda_graphs=True))


def test_remap_on_the_host_backend_is_refused_suggesting_copy_in():
    with pytest.raises(ss.InvalidArgumentError, match="remap, but backend 'host'.*copy_in"):
        _receiver(ss.ReceiverConfig(swap_strategy="remap"))


def test_an_unknown_strategy_name_is_refused_in_python():
    with pytest.raises(ss.InvalidArgumentError, match="'copyin' is not one of 'rebind'"):
        _receiver(ss.ReceiverConfig(swap_strategy="copyin"))


def test_worker_extension_with_copy_in_binds_once_and_steps_see_each_version_whole():
    loopback = ss.Loopback(2)
    worker = FakeWorker()
    layout, sender = _trainer(SPECS, loopback.transport(0))
    original = {n: p.data for n, p in worker.model_runner.model.params}
    worker.init_weight_update_group(specs=[tuple(vars(s).values()) for s in layout.specs],
                                    bucket_bytes=1024, transport=loopback.transport(1),
                                    swap_strategy="copy_in", engine_uses_cuda_graphs=True)
    try:
        bound = {n: p.data for n, p in worker.model_runner.model.params}
        # The engine's own arrays stay the live storage (what CUDA graphs captured before the
        # extension was initialized read): nothing was moved or rebound.
        assert all(bound[n] is original[n] for n in bound)
        assert worker._shadowsync.receiver.live_arena_pointer("base") is None
        handle = sender.publish(1, tensors(BASE + LORA, 1))
        worker.begin_update(handle.header_bytes)
        _step_until(worker, 1)  # steps: the swap callback waited for the copies
        handle.wait(DEADLINE_S)
        handle = sender.publish(2, tensors(LORA, 2))  # LoRA only
        worker.begin_update(handle.header_bytes)
        assert worker.wait_applied(2, DEADLINE_S) == 2
        handle.wait(DEADLINE_S)
        worker.execute_model("after")
        assert worker.steps[-1] == {1, 2}
        assert all(-1 not in seen for seen in worker.steps), worker.steps  # never a torn tensor
        params = dict(worker.model_runner.model.params)
        # The parameters still are the views bound at init: copy_in moved bytes, not tensors.
        assert all(params[n].data is bound[n] for n in params)
        assert [version_of(n, params[n].data) for n in BASE + LORA] == [1, 1, 1, 2, 2]
        assert np.shares_memory(params["embed"].data, bound["embed"])
    finally:
        worker.close_weight_update_group()
        sender.close()
