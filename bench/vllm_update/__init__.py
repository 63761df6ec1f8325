"""The pieces of bench/bench_vllm_update.py (whose docstring says what it measures and how), one
concept each; bench_vllm_pacing.py uses them too. What the benchmarks' reports share is in
bench/support/ (run_report.py, run_children.py), which importing this package puts on sys.path.
Standard library only at import: scripts/vllm_e2e.py imports engine_options_error without vLLM."""

import sys
from pathlib import Path

_SUPPORT = str(Path(__file__).resolve().parent.parent / "support")
if _SUPPORT not in sys.path:
    sys.path.insert(0, _SUPPORT)
