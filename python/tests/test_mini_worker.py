"""The mini vLLM-like worker (mini_worker.py: a small Llama from transformers, greedy decoding)
with shadowsync.vllm.WorkerExtension takes updates while it generates.

Per update: the trainer takes a "train step" (a seeded perturbation of its weights) and publishes
it streamed, bucket by bucket; before it supplies the last bucket it waits until the engine has
decoded STEPS_DURING_TRANSFER more steps, so steps provably run while the update is in flight.
Then every recorded step is checked bit for bit against a reference model (the same class,
weights put in with load_weights) at the version the step ran on: no step before a swap differs
from the old weights' reference, every step after it equals the new weights' reference.

Cases (the engine is always this process):
* cpu: torch CPU tensors, host backend, loopback ranks; the trainer in this process.
* cuda: trainer on cuda:0 and engine on cuda:1 of one process, CudaBackend and NCCL; needs a CUDA
  build of the library and two GPUs.
* cpu_same_host: the trainer in a second process (multiprocessing, spawn), torch CPU tensors,
  host backends, the same-host transport's host flavour (a shared memory file).
* cuda_same_host: the same two processes on ONE GPU (both on cuda:0), CudaBackend, the same-host
  transport's device flavour (the sender's staging slots in device memory, mapped by the engine);
  needs a CUDA build of the library and one GPU.
In both same_host cases the trainer hands the engine only plain values (socket path, token, tensor
specs), as it would a vLLM worker through collective_rpc, and the engine builds its transport from
them (ss.same_host_transport(path, token, rank, backend)).

The cpu cases run where torch and transformers are installed (skipped, listed, where not). With
SHADOWSYNC_REQUIRE_GPU_TESTS=1 (scripts/gpu/run.sh examples) the cuda cases fail instead of
skipping.

SHADOWSYNC_DEBUG_SAME_HOST=1 (run with -s): both processes trace on stderr what the update waits on
(each engine step's start and end, the release, each supply), stamped with time.monotonic() as the
same-host transport's own trace lines are, and dump every thread's Python stack once a step or an
update stalls (STALL_DUMP_S), long before the receiver's bucket deadline gives up.
"""

from __future__ import annotations

import contextlib
import faulthandler
import io
import multiprocessing
import os
import secrets
import shutil
import sys
import tempfile
import threading
import time
import traceback
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
DEADLINE_MS = int(DEADLINE_S * 1000)
TRACE = os.environ.get("SHADOWSYNC_DEBUG_SAME_HOST") == "1"
STALL_DUMP_S = 4.0  # below the receiver's bucket deadline (10 s), so the dump shows the stall


def _trace(who: str, message: str) -> None:
    """One diagnostic line on stderr (SHADOWSYNC_DEBUG_SAME_HOST=1), in the transport's format."""
    if TRACE:
        print(f"[mini-worker {who} pid {os.getpid()} t={time.monotonic():.6f}] {message}",
              file=sys.stderr, flush=True)


@contextlib.contextmanager
def _stall_dump(who: str, what: str):
    """While tracing: every thread's Python stack on stderr if `what` takes over STALL_DUMP_S.
    faulthandler keeps one watchdog per process, which each arming replaces and each cancel
    ends: only the engine's spans arm it (the trainer's supplies, in another thread, cancelled
    the dump of a stalled engine step in the traced runs at ad2a566); the others are traced."""
    if not TRACE:
        yield
        return
    _trace(who, f"{what}: start")
    dumps = who == "engine"
    if dumps:
        faulthandler.dump_traceback_later(STALL_DUMP_S, repeat=False, file=sys.stderr)
    try:
        yield
    finally:
        if dumps:
            faulthandler.cancel_dump_traceback_later()
        _trace(who, f"{what}: end")


def _need_cuda(reason: str):
    if os.environ.get("SHADOWSYNC_REQUIRE_GPU_TESTS") == "1":
        pytest.fail(f"SHADOWSYNC_REQUIRE_GPU_TESTS=1 but {reason}")
    pytest.skip(reason)


def _require_gpus(count: int):
    if not ss.has_cuda():
        _need_cuda(f"the library at {ss.library_path()} was built without CUDA")
    if not torch.cuda.is_available() or torch.cuda.device_count() < count:
        _need_cuda(f"needs {count} GPU(s), torch sees {torch.cuda.device_count()}")


class Trainer:
    """The trainer's copy of the model and its "train step": a seeded perturbation of every
    weight, large enough to change the logits."""

    def __init__(self, device: str, dtype: torch.dtype):
        self.model = build_model(seed=0, device=device, dtype=dtype)  # the engine's start weights
        self.device = device

    def named_parameters(self):
        return self.model.named_parameters()

    def weights(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.model.named_parameters()}

    @torch.no_grad()
    def train_step(self, version: int) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(version)
        for _, p in self.model.named_parameters():
            noise = torch.randn(p.shape, generator=generator, dtype=torch.float32)
            p.add_(noise.to(device=p.device, dtype=p.dtype), alpha=0.05)
        return self.weights()


def _publish(trainer: Trainer, sender, version: int, wait_for_release):
    """One update: the train step, the streamed publish, and a gather function that supplies each
    bucket from the trainer's parameters; before the last one it calls wait_for_release(), which
    returns once the engine made its steps during the transfer (or raises). Returns (weights,
    streamed, gather)."""
    weights = trainer.train_step(version)
    streamed = sender.publish_streamed(version, ["base"])
    buckets = len(streamed.buckets())
    supplied = [0]

    def gather(names, supply):
        supplied[0] += 1
        if supplied[0] == buckets:
            # The update cannot complete before this bucket: let the engine decode first.
            _trace("trainer", f"update {version}: waiting for the release before supply "
                              f"{supplied[0]} of {buckets}")
            wait_for_release()
            _trace("trainer", f"update {version}: released")
        params = dict(trainer.named_parameters())
        with _stall_dump("trainer", f"update {version}: supply {supplied[0]} of {buckets} "
                                    f"({names[0]}..{names[-1]})"):
            supply({n: params[n] for n in names})

    return weights, streamed, gather


# --- the trainer, as the engine's test loop sees it ----------------------------------------------
# start_update(version) -> header bytes (the update is then in flight; weights[version] is what it
# carries); release(): the engine made its steps, the last bucket may go; done(): the trainer
# finished sending (or failed); finish(): raises the trainer's failure; close().


class InProcessTrainer:
    """The trainer in this process: each update's gather runs on a thread of its own."""

    def __init__(self, trainer: Trainer, sender):
        self.trainer = trainer
        self.sender = sender
        self.weights = {0: trainer.weights()}
        self._thread = None

    def start_update(self, version: int) -> bytes:
        release = threading.Event()

        def wait_for_release():
            if not release.wait(DEADLINE_S):
                raise TimeoutError(
                    f"update {version}: the engine did not make {STEPS_DURING_TRANSFER} steps "
                    f"within {DEADLINE_S} s")

        weights, streamed, gather = _publish(self.trainer, self.sender, version, wait_for_release)
        self.weights[version] = weights
        self._release, self._failure, self._sent = release, [], threading.Event()

        def run():
            try:
                streamed.gather(gather).wait(DEADLINE_S)
            except BaseException as error:  # re-raised on the test's thread
                self._failure.append(error)
            finally:
                self._sent.set()

        self._version = version
        self._thread = threading.Thread(target=run, name=f"trainer v{version}")
        self._thread.start()
        return streamed.header_bytes

    def release(self):
        self._release.set()

    def done(self) -> bool:
        return self._sent.is_set()

    def failure_note(self) -> str:
        """Why the send failed, for a message (empty while none did)."""
        return f" (it failed: {self._failure[0]!r})" if self._failure else ""

    def finish(self):
        self._thread.join(DEADLINE_S)
        assert not self._thread.is_alive(), (
            f"update {self._version}: the trainer thread did not finish")
        if self._failure:
            raise self._failure[0]

    def close(self):
        if self._thread is not None:
            self._release.set()
            self._thread.join(DEADLINE_S)
        self.sender.close()


def _pack(weights: dict[str, torch.Tensor]) -> bytes:
    buffer = io.BytesIO()
    torch.save({n: t.cpu() for n, t in weights.items()}, buffer)
    return buffer.getvalue()


def _unpack(data: bytes) -> dict[str, torch.Tensor]:
    return torch.load(io.BytesIO(data), weights_only=True)


def _trainer_process(kind: str, conn) -> None:
    """The trainer process: its model, a same-host sender, then one update per ("update", v)
    message. Hands the engine plain values only: the socket path, the token, the specs. Reports
    failures as ("error", class name, message)."""
    directory = None
    try:
        torch.set_num_threads(1)  # the engine's process computes; this one mostly copies
        if kind == "cpu":
            trainer, backend, memory = Trainer("cpu", torch.float32), ss.HostBackend(), "host"
        else:
            trainer = Trainer("cuda:0", torch.bfloat16)
            backend, memory = ss.CudaBackend(0), "device"
        layout = ss.Layout.from_named_tensors(trainer.named_parameters(), bucket_bytes=BUCKET_BYTES)
        directory = tempfile.mkdtemp(prefix="ss_mini_worker_")  # mode 0700, as the transport needs
        path = os.path.join(directory, "trainer.sock")
        token = secrets.token_hex(16)
        # What a trainer passes each vLLM worker through collective_rpc.
        conn.send(("rendezvous", path, token, layout.specs, layout.fingerprint,
                   _pack(trainer.weights())))
        transport = ss.same_host_sender_transport(
            path, token, 1, backend, layout.groups[0].bucket_bytes, memory=memory,
            connect_timeout_ms=DEADLINE_MS)
        sender = ss.Sender(layout, backend, transport,
                           ss.SenderConfig(update_deadline_ms=DEADLINE_MS))
        conn.send(("connected", repr(transport)))
        while (message := conn.recv()) is not None:
            _, version = message

            def wait_for_release():
                if not conn.poll(DEADLINE_S):
                    raise TimeoutError(
                        f"update {version}: no release from the engine within {DEADLINE_S} s")
                got = conn.recv()
                if got != ("release", version):
                    raise RuntimeError(f"update {version}: expected the release, got {got!r}")

            weights, streamed, gather = _publish(trainer, sender, version, wait_for_release)
            conn.send(("header", version, streamed.header_bytes, _pack(weights)))
            handle = streamed.gather(gather)
            with _stall_dump("trainer", f"update {version}: the handle's wait"):
                handle.wait(DEADLINE_S)
            conn.send(("sent", version))
        sender.close()
        conn.send(("done",))
    except BaseException as error:  # noqa: BLE001 - everything goes back to the test
        conn.send(("error", type(error).__name__, f"{error}\n{traceback.format_exc()}"))
    finally:
        if directory is not None:
            shutil.rmtree(directory, ignore_errors=True)


class TrainerProcess:
    """The trainer in a second process (spawn: a fresh interpreter), driven over a pipe."""

    def __init__(self, kind: str):
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self._process = context.Process(target=_trainer_process, args=(kind, child),
                                        name=f"trainer ({kind})", daemon=True)
        self._process.start()
        child.close()
        self.weights = {}
        self._result = None

    def receive(self, what: str, expected: str):
        if not self._conn.poll(DEADLINE_S):
            pytest.fail(f"the trainer process sent nothing within {DEADLINE_S} s ({what})")
        message = self._conn.recv()
        if message[0] == "error":
            pytest.fail(f"the trainer process failed ({what}): {message[1]}: {message[2]}")
        assert message[0] == expected, f"{what}: expected '{expected}', got {message!r}"
        return message

    def start_update(self, version: int) -> bytes:
        self._conn.send(("update", version))
        _, got, header, weights = self.receive(f"update {version}: the header", "header")
        assert got == version
        self.weights[version] = _unpack(weights)
        self._version, self._result = version, None
        return header

    def release(self):
        self._conn.send(("release", self._version))

    def done(self) -> bool:
        if self._result is None and self._conn.poll(0):
            self._result = self._conn.recv()
        return self._result is not None

    def failure_note(self) -> str:
        """Why the trainer process failed, for a message (empty while it did not)."""
        failed = self._result is not None and self._result[0] == "error"
        return f" (it failed: {self._result[1:]})" if failed else ""

    def finish(self):
        if self._result is None:
            self._result = self.receive(f"update {self._version}: sent", "sent")
        if self._result[0] == "error":
            pytest.fail(f"the trainer process failed (update {self._version}): "
                        f"{self._result[1]}: {self._result[2]}")
        assert self._result == ("sent", self._version)

    def close(self, check: bool):
        """Ends the process; idempotent. `check`: the test passed so far, so the process must
        close its sender and report it; else (a failure is on its way up) only make sure it
        exits, killing it past the deadline, without raising over that failure."""
        if self._conn.closed:
            return
        try:
            if self._process.is_alive():
                try:
                    self._conn.send(None)  # ends its loop, or any wait of an update
                except OSError:
                    pass  # it exited: its report, if any, is in the pipe
                if check:
                    self.receive("shutdown", "done")
        finally:
            self._process.join(DEADLINE_S)
            alive = self._process.is_alive()
            if alive:
                self._process.kill()
                self._process.join()
            self._conn.close()
        if alive and check:
            pytest.fail(f"the trainer process did not exit within {DEADLINE_S} s")


# --- the cases' setups: (worker, trainer) with the weight update group initialized -----------


@contextlib.contextmanager
def _in_process(kind: str):
    if kind == "cpu":
        dtype = torch.float32
        worker = MiniWorker("cpu", dtype)
        trainer = Trainer("cpu", dtype)
        layout = ss.Layout.from_named_tensors(trainer.named_parameters(), bucket_bytes=BUCKET_BYTES)
        loopback = ss.Loopback(2)
        sender = ss.Sender(layout, ss.HostBackend(), loopback.transport(0),
                           ss.SenderConfig(update_deadline_ms=DEADLINE_MS))
        fingerprint = worker.init_weight_update_group(
            specs=layout.specs, bucket_bytes=BUCKET_BYTES, transport=loopback.transport(1),
            receiver_config=ss.ReceiverConfig(update_deadline_ms=DEADLINE_MS))
    else:
        _require_gpus(2)
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
                receiver_config=ss.ReceiverConfig(update_deadline_ms=DEADLINE_MS))
            transport = rank0.result(timeout=DEADLINE_S)
        sender = ss.Sender(layout, ss.CudaBackend(0), transport,
                           ss.SenderConfig(update_deadline_ms=DEADLINE_MS))
    assert fingerprint == layout.fingerprint
    trainer = InProcessTrainer(trainer, sender)
    try:
        yield worker, trainer
    finally:
        # Both ends at once, as at init: NCCL's teardown within a node waits for every rank's, so
        # one thread closing the receiver's communicator and then the sender's waits on itself.
        with ThreadPoolExecutor(1) as pool:
            closing = pool.submit(worker.close_weight_update_group)
            trainer.close()
            closing.result(timeout=DEADLINE_S)


@contextlib.contextmanager
def _same_host(kind: str):
    if kind == "cpu":
        device, dtype, backend = "cpu", torch.float32, ss.HostBackend()
    else:
        _require_gpus(1)
        device, dtype, backend = "cuda:0", torch.bfloat16, ss.CudaBackend(0)
    trainer = TrainerProcess(kind)
    worker = None
    try:
        _, path, token, specs, trainer_fingerprint, weights = trainer.receive(
            "the rendezvous", "rendezvous")
        trainer.weights[0] = _unpack(weights)
        worker = MiniWorker(device, dtype)
        # Plain values in, a transport out, as a vLLM worker's collective_rpc method would; rank 1
        # (the only engine; rank 0 is the trainer). Blocks until the trainer's sender listens.
        transport = ss.same_host_transport(path, token, 1, backend, connect_timeout_ms=DEADLINE_MS)
        fingerprint = worker.init_weight_update_group(
            specs=specs, bucket_bytes=BUCKET_BYTES, transport=transport,
            receiver_config=ss.ReceiverConfig(update_deadline_ms=DEADLINE_MS))
        assert fingerprint == trainer_fingerprint
        assert "same_host sender" in trainer.receive("connect", "connected")[1]
        yield worker, trainer
        trainer.close(check=True)
    finally:
        # The trainer first: its sender closes while the engine's side is still there.
        trainer.close(check=False)
        if worker is not None:
            worker.close_weight_update_group()


def _setup(case: str):
    if case.endswith("_same_host"):
        return _same_host(case.removesuffix("_same_host"))
    return _in_process(case)


# --- the test ------------------------------------------------------------------------------------


def _steps(worker, count: int):
    for _ in range(count):
        worker.execute_model()


def _finish(worker, trainer):
    """trainer.finish(); a failure also names the engine's receive error (a sender sees only
    that its peer went away when the receiver gave up)."""
    try:
        trainer.finish()
    except BaseException as error:
        engine = worker._shadowsync.receiver.last_update_error()
        if engine:
            pytest.fail(f"{error}\nthe engine's receiver: {engine}")
        raise


def _update_while_generating(worker, trainer, version: int):
    """One update while the engine keeps stepping: the header goes in, STEPS_DURING_TRANSFER
    steps run, the trainer may then supply its last bucket, and the engine keeps stepping until
    the update is live and the trainer is done sending (a swap before the last bucket is then
    caught by the checks below)."""
    header = trainer.start_update(version)
    worker.begin_update(header)  # returns at once; the receive is native
    _trace("engine", f"update {version}: begin_update")
    header_at = len(worker.outputs)
    released = False
    deadline = time.monotonic() + DEADLINE_S
    while not (trainer.done() and worker.outputs[-1].version == version):
        assert time.monotonic() < deadline, (
            f"version {version} not live within {DEADLINE_S} s; last step ran on version "
            f"{worker.outputs[-1].version}; the trainer {'is' if trainer.done() else 'is not'} "
            f"done sending{trainer.failure_note()}; the engine's receiver: "
            f"{worker._shadowsync.receiver.last_update_error() or 'no error'}")
        with _stall_dump("engine", f"update {version}: step {len(worker.outputs) - header_at}"):
            worker.execute_model()
        if not released and len(worker.outputs) - header_at >= STEPS_DURING_TRANSFER:
            trainer.release()
            _trace("engine", f"update {version}: release sent")
            released = True
        if trainer.done():
            _finish(worker, trainer)  # a failed send ends the wait at once, with its error
    _finish(worker, trainer)
    swap = next(i for i, o in enumerate(worker.outputs) if o.version == version)
    # Generation kept running while the update was in flight, on the old weights.
    during = worker.outputs[header_at:swap]
    assert len(during) >= STEPS_DURING_TRANSFER, (
        f"update {version}: {len(during)} steps between header and swap, expected at least "
        f"{STEPS_DURING_TRANSFER}")
    assert {o.version for o in during} == {version - 1}


def _check_against_reference(worker, weights: dict[int, dict[str, torch.Tensor]]):
    """Every step against the reference at its version, bit for bit."""
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


@pytest.mark.parametrize("case", ["cpu", "cuda", "cpu_same_host", "cuda_same_host"])
def test_generation_continues_and_logits_match_the_reference_bit_for_bit(case):
    with _setup(case) as (worker, trainer):
        # Every sequence length the worker decodes at runs once before the first update. On two
        # GPUs of one process (cuda) the first step of a length not run before hung until the
        # receiver's bucket deadline: the trainer here holds its last bucket back until the
        # engine has stepped, while the NCCL receive kernels of the held-back buckets already
        # wait on the engine's GPU, and that step waited for them (traced on 2x H200 at ad2a566:
        # step 2 of update 1, the first of length 8, in both runs; why a new length waits for
        # the whole device, whether a kernel's lazy load or an allocation, is not shown).
        _steps(worker, worker.max_len - worker.prompts.shape[1])
        for version in range(1, UPDATES + 1):
            _update_while_generating(worker, trainer, version)
            _steps(worker, STEPS_AFTER_SWAP)
        _check_against_reference(worker, trainer.weights)
