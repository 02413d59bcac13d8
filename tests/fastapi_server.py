"""The FastAPI example (examples/fastapi_app.py) served by a real uvicorn process, for tests."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType

import httpx

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
READY_WITHIN = 60.0  # seconds: imports and the lifespan's database check, bounded
STOP_WITHIN = 15.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class UvicornServer:
    """``uvicorn fastapi_app:app`` on 127.0.0.1, ready once ``GET /health`` answers 200."""

    def __init__(self, *, env: Mapping[str, str], app: str = "fastapi_app:app") -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._cmd = [sys.executable, "-m", "uvicorn", app, "--app-dir", str(EXAMPLES)]
        self._cmd += ["--host", "127.0.0.1", "--port", str(self.port), "--log-level", "warning"]
        self._env = {**os.environ, **env}
        self._proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> UvicornServer:
        self._proc = subprocess.Popen(self._cmd, env=self._env)
        deadline = time.monotonic() + READY_WITHIN
        while True:  # bounded: the deadline, or the process gone
            if self._proc.poll() is not None:
                raise RuntimeError(f"uvicorn exited with {self._proc.returncode}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1.0).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.__exit__(None, None, None)
                raise RuntimeError(f"uvicorn did not answer within {READY_WITHIN}s")
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
