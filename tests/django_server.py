"""The Django example project served by a real server process on loopback, for tests."""

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

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "django_project"
READY_WITHIN = 60.0  # seconds: Django's start-up, bounded


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class DjangoServer:
    """``uvicorn shop.asgi:application`` (ASGI) or ``manage.py runserver`` (WSGI)."""

    def __init__(self, *, env: Mapping[str, str], asgi: bool = True) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        if asgi:
            cmd = [sys.executable, "-m", "uvicorn", "shop.asgi:application", "--host"]
            cmd += ["127.0.0.1", "--port", str(self.port), "--lifespan", "off"]
            cmd += ["--log-level", "warning"]
        else:
            cmd = [sys.executable, "manage.py", "runserver", "--noreload", f"127.0.0.1:{self.port}"]
        self._cmd = cmd
        self._env = {**os.environ, "DJANGO_SETTINGS_MODULE": "shop.settings", **env}
        self._proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> DjangoServer:
        self._proc = subprocess.Popen(self._cmd, cwd=EXAMPLE, env=self._env)
        deadline = time.monotonic() + READY_WITHIN
        while True:  # bounded: the deadline, or the process gone
            if self._proc.poll() is not None:
                raise RuntimeError(f"the Django server exited with {self._proc.returncode}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1.0).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.__exit__(None, None, None)
                raise RuntimeError(f"the Django server did not answer within {READY_WITHIN}s")
            time.sleep(0.05)  # a polling interval, not a synchronisation

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._proc is None:
            return
        self._proc.terminate()
        try:
            self._proc.wait(10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(10)
