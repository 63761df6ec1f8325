"""The same paths with torch tensors (CPU, host backend). Skipped, visibly, where torch is not
installed; the GPU path (CudaBackend, NCCL, CUDA views) is tested on the GPU machine."""

import pytest

torch = pytest.importorskip("torch")

from support import BASE, DEADLINE_S, LORA, SPECS, pattern, version_of  # noqa: E402

import shadowsync as ss  # noqa: E402
from shadowsync.vllm import WorkerExtension  # noqa: E402


def torch_tensors(names, version):
    return {n: torch.from_numpy(pattern(n, version).copy()) for n in names}


def test_torch_tensors_publish_and_bad_ones_are_named(pair):
    bad = torch_tensors(BASE + LORA, 1)
    bad["norm"] = bad["norm"].to(torch.bfloat16)
    with pytest.raises(ss.InvalidArgumentError,
                       match=r"tensor 'norm': dtype bf16 \(torch.bfloat16\) does not match layout fp16"):
        pair.sender.publish(1, bad)
    bad = torch_tensors(BASE + LORA, 1)
    bad["embed"] = torch.zeros(4, 300).t()
    with pytest.raises(ss.InvalidArgumentError, match=r"tensor 'embed': not contiguous"):
        pair.sender.publish(1, bad)

    handle = pair.sender.publish(1, torch_tensors(BASE + LORA, 1).items())
    pair.receiver.begin_update(handle.header_bytes)
    pair.receiver.wait_applied(1, DEADLINE_S)
    handle.wait(DEADLINE_S)
    assert set(pair.live_versions().values()) == {1}


class TorchModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        for s in SPECS:
            self.register_parameter(s[0].replace(".", "_"), torch.nn.Parameter(
                torch.from_numpy(pattern(s[0], 0).copy()), requires_grad=False))

    def named_parameters(self, *args, **kwargs):  # the layout's names, dots included
        for s in SPECS:
            yield s[0], getattr(self, s[0].replace(".", "_"))


class TorchWorker(WorkerExtension):
    def __init__(self):
        self.model = TorchModel()

    def execute_model(self):
        return {version_of(n, p.data.numpy()) for n, p in self.model.named_parameters()}


def test_worker_extension_rebinds_torch_parameters():
    loopback = ss.Loopback(2)
    layout = ss.Layout(SPECS, bucket_bytes=1024)
    sender = ss.Sender(layout, ss.HostBackend(), loopback.transport(0))
    worker = TorchWorker()
    assert worker.init_weight_update_group(specs=layout.specs, bucket_bytes=1024,
                                           transport=loopback.transport(1)) == \
        layout.fingerprint
    assert worker.execute_model() == {0}
    handle = sender.publish(1, torch_tensors(BASE + LORA, 1))
    worker.begin_update(handle.header_bytes)
    worker.wait_applied(1, DEADLINE_S)
    assert worker.execute_model() == {1}
    for name, p in worker.model.named_parameters():
        assert p.data.data_ptr() == worker._shadowsync.receiver.live_pointer(name)
    handle.wait(DEADLINE_S)
    worker.close_weight_update_group()
    sender.close()


def test_a_tensor_changed_while_its_update_is_sent_is_named_never_silent(pair):
    """A torch tensor changed in place (an optimizer step) while its update is still being sent
    may reach the engines half old, half new. The update stays in flight here until the receiver
    begins it (loopback ranks meet in each broadcast), so the change certainly came first: the
    next publish is refused, naming the tensor, and the handle's wait raises once it is sent."""
    tensors = torch_tensors(BASE + LORA, 1)
    handle = pair.sender.publish(1, tensors)
    assert handle.changed_in_flight() is None
    with torch.no_grad():
        tensors["embed"].add_(1)  # what an optimizer step does to a parameter
    assert "tensor 'embed' was changed in place while update 1 was still being sent" in \
        handle.changed_in_flight()
    with pytest.raises(ss.ShadowsyncTimeoutError):
        handle.wait(0.01)  # still in flight: the receiver has not begun it
    with pytest.raises(ss.InvalidArgumentError,
                       match=r"update 2 not sent: tensor 'embed' was changed in place while "
                             r"update 1 was still being sent \(torch's version counter went "
                             r"from \d+ to \d+\)"):
        pair.sender.publish(2, torch_tensors(BASE + LORA, 2))
    pair.receiver.begin_update(handle.header_bytes)
    pair.receiver.wait_applied(1, DEADLINE_S)
    with pytest.raises(ss.InvalidArgumentError, match="publish again to make the engines' "
                                                      "weights whole"):
        handle.wait(DEADLINE_S)

    # Changed only once the update was sent: nothing to say.
    tensors = torch_tensors(BASE + LORA, 3)
    handle = pair.sender.publish(3, tensors)
    pair.receiver.begin_update(handle.header_bytes)
    pair.receiver.wait_applied(3, DEADLINE_S)
    handle.wait(DEADLINE_S)
    with torch.no_grad():
        tensors["embed"].add_(1)
    assert handle.changed_in_flight() is None
    handle = pair.sender.publish(4, torch_tensors(BASE + LORA, 4))
    pair.receiver.begin_update(handle.header_bytes)
    pair.receiver.wait_applied(4, DEADLINE_S)
    handle.wait(DEADLINE_S)
