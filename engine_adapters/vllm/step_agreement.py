"""Step agreement: commit_mode "auto" under tensor parallelism. The ranks of one engine make a
ready update live in their step hooks, every rank at the same step, decided over a page of shared
memory: no collective_rpc. (A commit_update collective_rpc holds vLLM's engine thread between two
steps and drains its asynchronous scheduling; docs/benchmarks.md has what that costs a swap.)

Rank 0 decides, the other ranks follow. Each rank numbers its steps (UpdateGroup.steps: vLLM sends
every rank every step, so the numbers agree). The page holds 8-byte words, each with one writer:

* a *promise* per follower, "ready for version v since my step s", written by the follower at the
  first step its receiver holds v ready (received, checked, held for a commit); from that step on
  it reads rank 0's decision at every step until v is live;
* a ring of rank 0's decisions, one word per step: the step, and whether the update its receiver
  holds ready goes live at it.

Rank 0 lets v go live at its step s only when its own receiver holds v ready and every follower
promised v since a step <= s and after the last commit (a promise from before it is stale: every
rank tells its agreement of each commit, the step hooks' and those between two steps alike). Each such follower reads the decision for s (it reads every step from
its promise on), and holds v ready until it commits (a receiver never drops a held update for a
newer one), so every rank commits v at step s, or none does. A follower that needs the decision for
its step before rank 0 wrote it waits for rank 0 to reach that step: the ranks run the same steps,
each step's forward waits for every rank's part, so the wait is short; a decision that does not
come within DECISION_DEADLINE_S, or that rank 0 overwrote (it ran RING steps ahead), stops the
step with an error rather than run it on another version than rank 0.

The ranks must share a host (the page is a file under /dev/shm); the set-up refuses otherwise.

The front end reads the page too (LiveWatch), so that apply_update_async learns an update went live
without a collective_rpc, which would hold the engine between two steps like a commit_update does.
Rank 0 writes three more words for it: a token naming this page, the version it made live last,
and whether the page was closed; the ring of decisions says how far rank 0 has stepped. Rank 0
keeps the page's descriptor open, so the front end opens the page through /proc/<pid>/fd (its
file is removed at the set-up, and a crash leaves nothing behind)."""

from __future__ import annotations

import mmap
import os
import secrets
import socket
import time

from shadowsync.errors import InvalidArgumentError

__all__ = ["RING", "LiveWatch", "StepAgreement", "open_for_tensor_parallel_group"]

RING = 64  # decisions kept: how far rank 0 may run ahead of a follower that waits for one
DECISION_DEADLINE_S = 60.0
_STEP_BITS = 40  # of a promise: its step (2**40 steps of 1 ms: 35 years)
_VERSION_MASK = (1 << 23) - 1  # of a promise: its version's low bits (a stale promise is one older)
_STEP_MASK = (1 << _STEP_BITS) - 1
_SHM_DIR = "/dev/shm"


# The words after the ring, rank 0's for the front end (LiveWatch): this page's token (never 0),
# the version rank 0 made live last, and 1 once the group is closed.
_TOKEN, _APPLIED, _CLOSED = range(3)
_FRONT_END_WORDS = 3


def _page_bytes(ranks: int) -> int:
    return 8 * (ranks + RING + _FRONT_END_WORDS)


def _promise(version: int, since: int) -> int:
    return ((version & _VERSION_MASK) << _STEP_BITS) | (since & _STEP_MASK)


class StepAgreement:
    """One rank's view of the page. `rank` 0 decides (goes_live), the others follow (the same
    call). Engine thread only."""

    def __init__(self, path: str, rank: int, ranks: int, create: bool = False):
        if ranks < 2 or not 0 <= rank < ranks:
            raise InvalidArgumentError(f"StepAgreement: rank {rank} of {ranks} ranks; give a rank "
                                       f"in 0..ranks-1 of 2 or more ranks")
        self.path, self.rank, self.ranks = path, rank, ranks
        size = _page_bytes(ranks)
        fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            elif os.fstat(fd).st_size != size:
                raise InvalidArgumentError(
                    f"StepAgreement: {path} holds {os.fstat(fd).st_size} bytes, {size} expected "
                    f"for {ranks} ranks; every rank must be of the same engine")
            self._map = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            raise
        # Rank 0 keeps the descriptor: the front end opens the page through it (reader()).
        self._fd = fd if rank == 0 else None
        if rank != 0:
            os.close(fd)
        # Zeroed: no promise, no decision. Each word is read and written whole: CPython copies a
        # memoryview item with one 8-byte memcpy, an aligned load or store (the map is page
        # aligned) that does not tear on x86-64 or AArch64; no rule spans two words.
        self._words = memoryview(self._map).cast("Q")
        self._promised = 0  # the promise this follower wrote last (0: none since the last commit)
        self._last_commit_step = 0  # rank 0: a promise must be from a later step
        self.waited_s = 0.0  # followers: the longest wait for a decision so far
        self._front_end = ranks + RING  # where the front end's words begin
        if rank == 0:
            self.token = secrets.randbits(63) | 1
            self._words[self._front_end + _TOKEN] = self.token

    def goes_live(self, step: int, ready: int) -> bool:
        """At step `step` (>= 1) with `ready` the version this rank's receiver holds ready (0:
        none): whether this rank commits it now. Every rank gets the same answer for a step at
        which any of them commits."""
        return self._decide(step, ready) if self.rank == 0 else self._follow(step, ready)

    def committed(self, step: int, version: int) -> None:
        """Every rank, at each commit of `version` (the last step its hook ran, for one between
        two steps): a promise written up to `step` is for an update that is live now. Rank 0
        tells the front end (LiveWatch)."""
        self._last_commit_step = step
        self._promised = 0
        if self.rank == 0:
            self._words[self._front_end + _APPLIED] = version

    def reader(self) -> dict | None:
        """Rank 0: where the front end opens this page (LiveWatch.open's arguments); None on the
        other ranks or once closed."""
        if self._fd is None or self._map is None:
            return None
        return {"path": f"/proc/{os.getpid()}/fd/{self._fd}", "token": self.token,
                "ranks": self.ranks}

    def _decide(self, step: int, ready: int) -> bool:
        words = self._words
        go = ready != 0
        if go:
            want, after = ready & _VERSION_MASK, self._last_commit_step
            for follower in range(1, self.ranks):
                promise = words[follower]
                if (promise >> _STEP_BITS != want
                        or not after < promise & _STEP_MASK <= step):
                    go = False
                    break
        words[self.ranks + step % RING] = (step << 1) | go
        return go

    def _follow(self, step: int, ready: int) -> bool:
        if ready == 0:
            return False  # rank 0 cannot decide for a version this rank does not hold
        words = self._words
        if self._promised == 0:  # the first step that holds it since the last commit
            self._promised = words[self.rank] = _promise(ready, step)
        slot = self.ranks + step % RING
        decision = words[slot]
        if decision >> 1 < step:
            started = time.monotonic()
            spins = 0
            while decision >> 1 < step:
                spins += 1
                if spins > 1000:  # rank 0 is late by more than a moment: stop spinning
                    time.sleep(0.00005)
                if time.monotonic() - started > DECISION_DEADLINE_S:
                    raise RuntimeError(
                        f"shadowsync: tensor-parallel rank {self.rank} holds update {ready} ready "
                        f"and waited {DECISION_DEADLINE_S:.0f} s at step {step} for rank 0's "
                        f"decision (the last it wrote there is for step {decision >> 1}); rank 0 "
                        f"no longer steps with this one, so this step stops here rather than run "
                        f"on another version than rank 0")
                os.sched_yield()
                decision = words[slot]
            self.waited_s = max(self.waited_s, time.monotonic() - started)
        if decision >> 1 != step:
            raise RuntimeError(
                f"shadowsync: tensor-parallel rank {self.rank} at step {step} finds rank 0's "
                f"decision for step {decision >> 1} in its place: rank 0 ran {RING} or more steps "
                f"ahead, so this step stops here rather than run on another version than rank 0")
        return bool(decision & 1)

    def close(self, unlink: bool = False) -> None:
        """Unmaps the page (and removes its file with `unlink`, if still there). Rank 0 first
        marks it closed, for a front end that still maps it."""
        if self._map is None:
            return
        if self.rank == 0:
            self._words[self._front_end + _CLOSED] = 1
            os.close(self._fd)
            self._fd = None
        self._words.release()
        self._map.close()
        self._map = None
        if unlink:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


class LiveWatch:
    """The front end's read-only view of rank 0's page: which version is live and how far rank 0
    has stepped, read without asking the engine (apply_update_async). Same host only."""

    def __init__(self, path: str, token: int, ranks: int):
        size = _page_bytes(ranks)
        fd = os.open(path, os.O_RDONLY)
        try:
            if os.fstat(fd).st_size != size:
                raise OSError(f"{path} holds {os.fstat(fd).st_size} bytes, {size} expected")
            self._map = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        self._words = memoryview(self._map).cast("Q")
        self._ring = slice(ranks, ranks + RING)
        self._front_end = ranks + RING
        if self._words[self._front_end + _TOKEN] != token:
            # The descriptor number was reused: the group closed between the answer and the open.
            self.close()
            raise OSError(f"{path} is not the page of token {token:#x}")

    @classmethod
    def open(cls, reader: dict | None) -> LiveWatch | None:
        """The page a worker's update_progress named (StepAgreement.reader), or None where it
        cannot be opened (another host, another /proc): the caller asks the workers instead."""
        if not reader:
            return None
        try:
            return cls(str(reader["path"]), int(reader["token"]), int(reader["ranks"]))
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def read(self) -> tuple[int, int] | None:
        """(the version rank 0 made live last, rank 0's last step), or None once the group is
        closed."""
        words = self._words
        if self._map is None or words[self._front_end + _CLOSED]:
            return None
        applied = words[self._front_end + _APPLIED]
        return applied, max(words[self._ring]) >> 1

    def close(self) -> None:
        if self._map is not None:
            self._words.release()
            self._map.close()
            self._map = None


def open_for_tensor_parallel_group(gathered) -> StepAgreement:
    """Every rank of vLLM's tensor-parallel group calls this at the same point of the set-up
    (`gathered`: tensor_parallel.gathered, an all-gather over the group): rank 0 creates the page,
    every rank opens it, rank 0 removes its file once all did (a crash leaves nothing behind).
    InvalidArgumentError on every rank when the ranks are on more than one host or any rank could
    not open it."""
    host = socket.gethostname()
    own, error = None, None
    path = None
    values, rank = gathered(None)  # this rank's index and the group's size first
    ranks = len(values)
    if rank == 0:
        try:
            path = os.path.join(_SHM_DIR, f"shadowsync-steps-{os.getpid()}-{secrets.token_hex(8)}")
            own = StepAgreement(path, 0, ranks, create=True)
        except Exception as failure:  # noqa: BLE001 - every rank must reach the next round
            error = f"rank 0 could not create {path}: {failure}"
    told, _ = gathered((host, path, error))
    hosts = sorted({h for h, _, _ in told})
    path, error = told[0][1], told[0][2]
    if error is None and len(hosts) > 1:
        error = (f"the tensor-parallel ranks run on {len(hosts)} hosts ({', '.join(hosts)}), and "
                 f"the ranks agree on the step over shared memory of one host")
    if error is None and rank != 0:
        try:
            own = StepAgreement(path, rank, ranks)
        except FileNotFoundError:
            error = (f"rank {rank} finds no {path}, which rank 0 created on the same host: the "
                     f"ranks do not share {_SHM_DIR} (a container without --ipc=host?)")
        except Exception as failure:  # noqa: BLE001 - every rank must reach the next round
            error = f"rank {rank} could not open {path}: {failure}"
    errors, _ = gathered(error)
    if rank == 0 and own is not None:
        try:
            os.unlink(path)  # every rank that could open it has
        except OSError:
            pass
    failed = [e for e in errors if e is not None]
    if failed:
        if own is not None:
            own.close()
        raise InvalidArgumentError(
            f"init_weight_update_group: commit_mode \"auto\" under tensor parallelism: {failed[0]}; "
            f"leave commit_mode unset (coordinated: updates go live by "
            f"shadowsync.vllm.commit_update)")
    return own
