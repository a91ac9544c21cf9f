"""A real redis-server (Debian's, installed by `make tools`) on a free loopback port, for the
tests of rate limits shared through Redis."""

import contextlib
import shutil
import subprocess
import time
from pathlib import Path

import redis

from tests.net import free_port


class RedisServer:
    """A redis-server on a loopback port, stopped and started again at will."""

    def __init__(self, directory: Path) -> None:
        binary = shutil.which("redis-server")
        assert binary, "redis-server is missing: `make tools` installs Debian's redis-server"
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._command = [
            binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "no", "--dir", str(directory),
        ]  # fmt: skip
        self._popen: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self._popen = subprocess.Popen(self._command, stdout=subprocess.DEVNULL)
        client = redis.Redis(port=self.port, socket_connect_timeout=1)
        for _ in range(300):  # bounded only to stop a hang
            with contextlib.suppress(redis.exceptions.ConnectionError):
                if client.ping():
                    return
            assert self._popen.poll() is None, "redis-server exited"
            time.sleep(0.1)
        raise AssertionError("redis-server did not answer PING")

    def stop(self) -> None:
        if self._popen is not None:
            self._popen.kill()
            self._popen.wait()
            self._popen = None
