"""The Python benchmarks' child processes (bench_vllm_update.py, bench_vllm_pacing.py): each runs
with its output in a log of its own and a deadline, and a failure is reported with the log's
telling lines. Standard library only."""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path


def run_logged(command: list[str], log_file: Path, timeout_s: float) -> int:
    """Runs `command` with stdout and stderr into `log_file`; its own process group, killed as a
    whole at the deadline (vLLM's engine processes with it). Returns the exit code (124: timed
    out)."""
    with open(log_file, "w") as f:
        f.write("$ " + " ".join(shlex.quote(c) for c in command) + "\n")
        f.flush()
        process = subprocess.Popen(command, stdout=f, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        try:
            return process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, 9)
            process.wait()
            return 124
        finally:
            # Anything the child left behind in its group (an engine core whose parent died).
            try:
                os.killpg(process.pid, 9)
            except ProcessLookupError:
                pass


def tail(path: Path, chars: int = 1500) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError as e:
        return f"(no log: {e})"
    lines = [ln for ln in text.splitlines() if ln.strip()]
    # The first error line tells most; then the end.
    marks = [ln for ln in lines if "Error" in ln or "error:" in ln or "FAILED" in ln][:3]
    return (" | ".join(marks) + " || " if marks else "") + "\n".join(lines)[-chars:]
