"""A web server in its own process on 127.0.0.1, for tests: started, ready once
``GET /health`` answers 200, stopped with SIGTERM. Or started to see it refuse to start."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from types import TracebackType

import httpx
from fastapi_server import free_port

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
READY_WITHIN = 60.0  # seconds: imports and the start-up's database check, bounded
STOP_WITHIN = 15.0
REFUSE_WITHIN = 60.0

Command = Callable[[int], list[str]]  # the command line for a port


def uvicorn_command(app: str, *, factory: bool = False, app_dir: Path = TESTS) -> Command:
    """``python -m uvicorn app`` on 127.0.0.1 and the port."""

    def command(port: int) -> list[str]:
        cmd = [sys.executable, "-m", "uvicorn", app, "--app-dir", str(app_dir)]
        cmd += ["--factory"] if factory else []
        return [*cmd, "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]

    return command


def script_command(script: Path) -> Command:
    """``python script PORT``: a script that serves on 127.0.0.1 and the port it is given."""
    return lambda port: [sys.executable, str(script), str(port)]


class ServerProcess:
    """The server of ``command`` in a child process, with ``env`` over the environment."""

    def __init__(self, command: Command, *, env: Mapping[str, str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._cmd = command(self.port)
        self._env = {**os.environ, **env, "PYTHONPATH": _pythonpath()}
        self._proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> ServerProcess:
        self._proc = subprocess.Popen(self._cmd, env=self._env)
        deadline = time.monotonic() + READY_WITHIN
        while True:  # bounded: the deadline, or the process gone
            if self._proc.poll() is not None:
                raise RuntimeError(f"{self._cmd[:4]} exited with {self._proc.returncode}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1.0).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.__exit__(None, None, None)
                raise RuntimeError(f"{self._cmd[:4]} did not answer within {READY_WITHIN}s")
            time.sleep(0.05)  # a polling interval, not a synchronisation

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        proc.terminate()  # SIGTERM: uvicorn runs the lifespan's shutdown
        try:
            proc.wait(STOP_WITHIN)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(STOP_WITHIN)


def refused_start(command: Command, *, env: Mapping[str, str]) -> subprocess.CompletedProcess[str]:
    """Start the server and wait for it to exit by itself (it must refuse to start)."""
    return subprocess.run(
        command(free_port()),
        env={**os.environ, **env, "PYTHONPATH": _pythonpath()},
        capture_output=True,
        text=True,
        timeout=REFUSE_WITHIN,
        check=False,
    )


def _pythonpath() -> str:
    # The tests' helper modules (a served app imports them), before whatever was there.
    return os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH", "")) if p)
