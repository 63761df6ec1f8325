"""Graph pairs: vLLM's CUDA graphs captured twice, once over each slot of the weights, so that a
swap only switches which set vLLM replays.

A captured CUDA graph reads the weights at the addresses it was captured with. The live arena
(live_arena.py) keeps one address range live and remaps it onto the other slot at each swap: the
graphs read the new weights, but the remap is page-table work on the engine's stream (about 1 ms
at Llama-3-8B on an H100: docs/benchmarks.md, "The remap's own cost"). Graph pairs move no pages:
both slots stay mapped at their own addresses for the engine's life, vLLM's graphs are captured
once with the parameters pointing at slot 0 and once at slot 1, and a swap (on the engine
thread, between two steps) points the parameters at the other slot and hands vLLM that slot's
graphs. Nothing is copied, remapped or synchronized; the step in flight goes on reading the old
slot, which the receiver does not write before that step is done (its release event).

    llm = vllm.LLM(model=..., worker_extension_cls="shadowsync.vllm.WorkerExtension",
                   weight_transfer_config={"backend": "shadowsync_graph_pairs"})

What holds vLLM 0.25's graphs, and is switched: the V2 GPU runner's CudaGraphManager (its FULL
graphs, one dict keyed by batch descriptor) and every CUDAGraphWrapper (the PIECEWISE graphs
inside the compiled model, each a dict of entries by batch descriptor; on the V1 GPU runner,
which vLLM runs for the models its V2 runner does not take yet, such as mixture-of-experts ones,
the FULL graphs too: a CUDAGraphWrapper around the whole model). Each set is captured by vLLM's
own capture_model, run twice: the second run starts from empty dicts, and vLLM's graph pool
serves both sets as it serves its graphs of every batch size (only one graph replays at a time).
Refused at start-up, naming why: a runner not found, a speculative decoder (its graphs are
captured beside the model's and are not switched), vLLM's breakable CUDA graphs, and on the V1
runner micro-batching (its UBatchWrapper keeps its own graphs) and a multimodal encoder's graphs
(kept by the runner's encoder graph manager). Costs: capture takes twice as long at start-up, and the second set's
graph memory: where vLLM's memory profile estimates its graphs (VLLM_MEMORY_PROFILER_ESTIMATE_
CUDAGRAPHS, on by default) the estimate is doubled, so the KV cache is sized with room for both.
"""

from __future__ import annotations

from typing import Any, Callable

from shadowsync.errors import InvalidArgumentError

__all__ = ["GraphSets", "why_unswitchable"]


class GraphSets:
    """The CUDA graphs of one model runner, one set per weight slot. `bind(slot)` points the
    model's parameters at that slot's copy of the weights; `slot` is the one they point at now.

    capture_model() replaces the runner's own (install() puts it there): it captures vLLM's graphs
    over each slot in turn. use(slot) makes vLLM replay that slot's set; engine thread, between
    two steps."""

    def __init__(self, runner, bind: Callable[[int], None], slot: int):
        _refuse_unswitchable(runner)
        self.runner = runner
        self.bind = bind
        self.slot = slot
        self.sets: list[dict | None] = [None, None]  # by slot: what holds that slot's graphs
        self.graph_bytes = 0  # what both captures took (memory_report)
        self._capture = runner.capture_model
        self._profile = getattr(runner, "profile_cudagraph_memory", None)

    def install(self) -> None:
        """vLLM calls runner.capture_model() once, after it sized its KV cache: capture both
        sets there instead. Before that, where vLLM's memory profile estimates what its graphs
        will take (profile_cudagraph_memory), the estimate is doubled, so that the KV cache is
        sized with room for both sets. Attributes on the instance shadow the class's methods."""
        self.runner.capture_model = self.capture_model
        if callable(self._profile):
            self.runner.profile_cudagraph_memory = self.profile_cudagraph_memory

    def profile_cudagraph_memory(self) -> int:
        """vLLM's estimate of one set of graphs, twice: graph pairs capture one set per slot."""
        return 2 * int(self._profile())

    def capture_model(self) -> int:
        """vLLM's capture, over the live slot and then over the other; returns the bytes both
        took (vLLM logs it). The parameters and vLLM's graphs are the live slot's afterwards."""
        live, other = self.slot, 1 - self.slot
        graph_bytes = self._capture()
        self.sets[live] = self._held()
        self._hold(_empty_like(self.sets[live]))
        self.bind(other)
        try:
            graph_bytes += self._capture()
            self.sets[other] = self._held()
        finally:
            self.bind(live)
            self._hold(self.sets[live])
        self.graph_bytes = graph_bytes
        print(f"[shadowsync] graph pairs: vLLM's CUDA graphs captured over both weight slots "
              f"({_count(self.sets[live])} graphs each, {graph_bytes / 2**30:.2f} GiB in all)",
              flush=True)
        return graph_bytes

    def use(self, slot: int) -> None:
        """vLLM's next step replays `slot`'s graphs (the parameters must point at it already).
        Engine thread."""
        if slot == self.slot:
            return
        if self.sets[slot] is not None:
            self._hold(self.sets[slot])
        elif self.sets[1 - slot] is not None:
            # Graphs over one slot only (its second capture failed and vLLM went on): vLLM would
            # replay them over the other slot's weights.
            raise InvalidArgumentError(
                f"graph pairs: vLLM's CUDA graphs were captured over slot {1 - slot} only, so "
                f"the parameters cannot move to slot {slot}")
        self.slot = slot  # no graphs at all (enforce_eager): only the parameters move

    def _holders(self) -> tuple[Any, list]:
        """The runner's CudaGraphManager (None on the V1 runner) and every CUDAGraphWrapper."""
        return getattr(self.runner, "cudagraph_manager", None), _cuda_graph_wrappers()

    def _held(self) -> dict:
        """The dicts that hold the graphs now (the objects, not copies)."""
        manager, wrappers = self._holders()
        return {"manager": (manager, manager.graphs if manager is not None else None),
                "wrappers": [(w, w.concrete_cudagraph_entries) for w in wrappers]}

    @staticmethod
    def _hold(held: dict) -> None:
        """Makes vLLM look its graphs up in `held`'s dicts."""
        manager, graphs = held["manager"]
        if manager is not None:
            manager.graphs = graphs
        for wrapper, entries in held["wrappers"]:
            wrapper.concrete_cudagraph_entries = entries


def _cuda_graph_wrappers() -> list:
    """Every CUDAGraphWrapper of the process (vLLM keeps a weak set of them): the model's
    PIECEWISE graphs, and on the V1 runner its FULL graphs too."""
    from vllm.compilation.cuda_graph import CUDAGraphWrapper

    return list(CUDAGraphWrapper._all_instances)


def _empty_like(held: dict) -> dict:
    """The same holders with new, empty dicts (vLLM's capture fills what it finds empty)."""
    manager, graphs = held["manager"]
    return {"manager": (manager, {} if graphs is not None else None),
            "wrappers": [(w, {}) for w, _ in held["wrappers"]]}


def _count(held: dict) -> int:
    _, graphs = held["manager"]
    return (len(graphs) if graphs else 0) + sum(len(e) for _, e in held["wrappers"])


def why_unswitchable(runner) -> str | None:
    """Why this module cannot switch `runner`'s graphs (None: it can)."""
    if not callable(getattr(runner, "capture_model", None)):
        return f"the model runner ({type(runner).__name__}) has no capture_model"
    v2 = hasattr(runner, "cudagraph_manager")
    if not v2 and not hasattr(runner, "cudagraph_dispatcher"):
        return (f"the model runner ({type(runner).__name__}) is neither of vLLM's GPU runners "
                f"(V2, V1) whose graph holders this module switches (another keeps graphs "
                f"elsewhere)")
    if not v2:
        # The V1 runner: every graph of the model is a CUDAGraphWrapper's, unless these hold
        # some.
        if getattr(getattr(runner, "parallel_config", None), "use_ubatching", False):
            return ("vLLM splits batches into micro-batches (its UBatchWrapper keeps those CUDA "
                    "graphs, which are not switched)")
        compilation = getattr(runner, "compilation_config", None)
        if getattr(compilation, "cudagraph_mm_encoder", False) and \
                getattr(runner, "supports_mm_inputs", False):
            return ("vLLM captures CUDA graphs of the model's multimodal encoder (its encoder "
                    "graph manager keeps them, and they are not switched)")
    if getattr(runner, "speculator", None) is not None or \
            getattr(runner, "drafter", None) is not None:
        return ("vLLM runs a speculative decoder, whose CUDA graphs are captured beside the "
                "model's and would not be switched")
    if _breakable_cuda_graphs():
        return "vLLM's breakable CUDA graphs (VLLM_USE_BREAKABLE_CUDAGRAPH=1) are on"
    return None


def _refuse_unswitchable(runner) -> None:
    """Graphs this module cannot switch, refused at start-up rather than replayed over the wrong
    slot."""
    why = why_unswitchable(runner)
    if why is not None:
        raise InvalidArgumentError(
            f"the 'shadowsync_graph_pairs' weight-transfer backend: {why}; use the backend "
            f"'shadowsync' (it chooses the live arena, swapped by remap, there) instead")


def _breakable_cuda_graphs() -> bool:
    """Whether vLLM captures breakable CUDA graphs (its runner keeps those in an object of its
    own, which is not switched)."""
    try:
        import vllm.envs as envs
    except ImportError:
        return False
    return bool(getattr(envs, "VLLM_USE_BREAKABLE_CUDAGRAPH", False))
