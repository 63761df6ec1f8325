"""The mini vLLM-like worker (mini_worker.py: a small Llama from transformers, greedy decoding)
with shadowsync.vllm.WorkerExtension takes updates while it generates.

Per update: the trainer takes a "train step" (a seeded perturbation of its weights) and publishes
it streamed, bucket by bucket; before it supplies the last bucket it waits until the engine has
decoded STEPS_DURING_TRANSFER more steps, so steps provably run while the update is in flight.
Then every recorded step is checked bit for bit against a reference model (the same class,
weights put in with load_weights) at the version the step ran on: no step before a swap differs
from the old weights' reference, every step after it equals the new weights' reference.

cpu: torch CPU tensors, host backend, loopback ranks (runs in CI where torch and transformers are
installed; skipped, listed, where not). cuda: trainer on cuda:0 and engine on cuda:1 of one
process, CudaBackend and NCCL; needs a CUDA build of the library and two GPUs. With
SHADOWSYNC_REQUIRE_GPU_TESTS=1 (scripts/gpu/run.sh examples) the cuda case fails instead of
skipping.
"""

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from mini_worker import MiniWorker, build_model  # noqa: E402
from support import DEADLINE_S  # noqa: E402

import shadowsync as ss  # noqa: E402

UPDATES = 3
STEPS_DURING_TRANSFER = 3  # engine steps between the header and the last bucket, per update
STEPS_AFTER_SWAP = 2
BUCKET_BYTES = 16 << 10  # the fp32 model is ~420 KiB: ~26 buckets


def _need_cuda(reason: str):
    if os.environ.get("SHADOWSYNC_REQUIRE_GPU_TESTS") == "1":
        pytest.fail(f"SHADOWSYNC_REQUIRE_GPU_TESTS=1 but {reason}")
    pytest.skip(reason)


class Trainer:
    """The trainer's copy of the model and its "train step": a seeded perturbation of every
    weight, large enough to change the logits."""

    def __init__(self, device: str, dtype: torch.dtype):
        self.model = build_model(seed=0, device=device, dtype=dtype)  # the engine's start weights
        self.device = device

    def named_parameters(self):
        return self.model.named_parameters()

    @torch.no_grad()
    def train_step(self, version: int) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(version)
        for _, p in self.model.named_parameters():
            noise = torch.randn(p.shape, generator=generator, dtype=torch.float32)
            p.add_(noise.to(device=p.device, dtype=p.dtype), alpha=0.05)
        return {n: p.detach().clone() for n, p in self.model.named_parameters()}


class StepCounter:
    """Engine steps, for the trainer thread to wait on (a condition with a deadline, no sleep)."""

    def __init__(self):
        self._count = 0
        self._cv = threading.Condition()

    def step(self):
        with self._cv:
            self._count += 1
            self._cv.notify_all()

    @property
    def count(self) -> int:
        with self._cv:
            return self._count

    def wait_for(self, target: int, timeout: float) -> bool:
        with self._cv:
            return self._cv.wait_for(lambda: self._count >= target, timeout)


def _setup(backend_kind: str):
    """(worker, trainer, sender, layout) with the weight update group initialized."""
    if backend_kind == "cpu":
        dtype = torch.float32
        worker = MiniWorker("cpu", dtype)
        trainer = Trainer("cpu", dtype)
        layout = ss.Layout.from_named_tensors(trainer.named_parameters(), bucket_bytes=BUCKET_BYTES)
        loopback = ss.Loopback(2)
        sender = ss.Sender(layout, ss.HostBackend(), loopback.transport(0),
                           ss.SenderConfig(update_deadline_ms=int(DEADLINE_S * 1000)))
        fingerprint = worker.init_weight_update_group(
            specs=layout.specs, bucket_bytes=BUCKET_BYTES, transport=loopback.transport(1),
            receiver_config=ss.ReceiverConfig(update_deadline_ms=int(DEADLINE_S * 1000)))
    else:
        if not ss.has_cuda():
            _need_cuda(f"the library at {ss.library_path()} was built without CUDA")
        if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
            _need_cuda(f"needs 2 GPUs, torch sees {torch.cuda.device_count()}")
        dtype = torch.bfloat16
        worker = MiniWorker("cuda:1", dtype)
        trainer = Trainer("cuda:0", dtype)
        layout = ss.Layout.from_named_tensors(trainer.named_parameters(), bucket_bytes=BUCKET_BYTES)
        unique_id = ss.nccl_unique_id()
        # Both ranks block in NCCL's init until the other joined: the trainer's in a thread.
        with ThreadPoolExecutor(1) as pool:
            rank0 = pool.submit(ss.nccl_transport, unique_id, 0, 2, 0)
            fingerprint = worker.init_weight_update_group(
                unique_id=unique_id, rank_offset=1, world_size=2, specs=layout.specs,
                bucket_bytes=BUCKET_BYTES,
                receiver_config=ss.ReceiverConfig(update_deadline_ms=int(DEADLINE_S * 1000)))
            transport = rank0.result(timeout=DEADLINE_S)
        sender = ss.Sender(layout, ss.CudaBackend(0), transport,
                           ss.SenderConfig(update_deadline_ms=int(DEADLINE_S * 1000)))
    assert fingerprint == layout.fingerprint
    return worker, trainer, sender, layout


def _step_until(worker, counter, done, what: str):
    deadline = time.monotonic() + DEADLINE_S
    while not done():
        assert time.monotonic() < deadline, (
            f"{what} not reached within {DEADLINE_S} s; last step ran on version "
            f"{worker.outputs[-1].version if worker.outputs else None}")
        worker.execute_model()
        counter.step()


@pytest.mark.parametrize("backend_kind", ["cpu", "cuda"])
def test_generation_continues_and_logits_match_the_reference_bit_for_bit(backend_kind):
    worker, trainer, sender, layout = _setup(backend_kind)
    try:
        counter = StepCounter()
        weights = {0: {n: p.detach().clone() for n, p in trainer.named_parameters()}}
        swap_steps = {}  # version -> index of the first step that ran on it
        for _ in range(STEPS_AFTER_SWAP):
            worker.execute_model()
            counter.step()

        for version in range(1, UPDATES + 1):
            weights[version] = trainer.train_step(version)
            streamed = sender.publish_streamed(version, ["base"])
            worker.begin_update(streamed.header_bytes)  # returns at once; the receive is native
            header_at = counter.count
            buckets = len(streamed.buckets())
            failure = []
            supplied = [0]  # buckets

            def gather(names, supply):
                supplied[0] += 1
                if supplied[0] == buckets:
                    # The update cannot complete before this bucket: let the engine decode first.
                    if not counter.wait_for(header_at + STEPS_DURING_TRANSFER, DEADLINE_S):
                        raise TimeoutError(
                            f"update {version}: the engine made {counter.count - header_at} of "
                            f"{STEPS_DURING_TRANSFER} steps within {DEADLINE_S} s")
                params = dict(trainer.named_parameters())
                supply({n: params[n] for n in names})

            sent = threading.Event()

            def run_trainer():
                try:
                    streamed.gather(gather).wait(DEADLINE_S)
                except BaseException as error:  # re-raised on the test's thread
                    failure.append(error)
                finally:
                    sent.set()

            thread = threading.Thread(target=run_trainer, name=f"trainer v{version}")
            thread.start()
            try:
                # The engine keeps stepping until the update is live and the trainer is done
                # sending (a swap before the last bucket is then caught by the checks below).
                _step_until(worker, counter, lambda: sent.is_set() and (
                    bool(failure) or worker.outputs[-1].version == version),
                    f"version {version} live")
            finally:
                thread.join(DEADLINE_S)
            assert not thread.is_alive(), f"update {version}: the trainer thread did not finish"
            if failure:
                raise failure[0]
            swap_steps[version] = next(i for i, o in enumerate(worker.outputs) if o.version == version)
            # Generation kept running while the update was in flight, on the old weights.
            during = worker.outputs[header_at:swap_steps[version]]
            assert len(during) >= STEPS_DURING_TRANSFER, (
                f"update {version}: {len(during)} steps between header and swap, expected at least "
                f"{STEPS_DURING_TRANSFER}")
            assert {o.version for o in during} == {version - 1}
            for _ in range(STEPS_AFTER_SWAP):
                worker.execute_model()
                counter.step()

        # Every step against the reference at its version, bit for bit.
        versions = [o.version for o in worker.outputs]
        assert versions == sorted(versions), f"applied versions went back: {versions}"
        assert set(versions) == set(range(UPDATES + 1))
        reference = MiniWorker(str(worker.device), worker.model.dtype, seed=99)  # other weights
        probes = []  # per version: the reference's logits on the first step's tokens
        for version in range(UPDATES + 1):
            assert reference.load_weights(weights[version].items()) == set(weights[version])
            for index, out in enumerate(worker.outputs):
                if out.version != version:
                    continue
                expected = reference.logits(out.input_ids).float().cpu()
                if not torch.equal(out.logits, expected):
                    diff = (out.logits - expected).abs().max().item()
                    pytest.fail(
                        f"step {index} ran on version {version}: its logits differ from those of "
                        f"the reference loaded with version {version} by up to {diff}")
                assert torch.equal(out.next_tokens, expected.argmax(dim=-1))
            probes.append(reference.logits(worker.outputs[0].input_ids).float().cpu())
        # Not vacuous: each update changes the logits (a worker that never swapped would fail).
        for version in range(1, UPDATES + 1):
            assert not torch.equal(probes[version - 1], probes[version]), (
                f"versions {version - 1} and {version} give the same logits")
    finally:
        worker.close_weight_update_group()
        sender.close()

