"""A real S3 API server for the tests: moto's (`moto[server]` from PyPI), started by the suite on a free local port.

Every client the project uses finds it through the standard AWS environment (`environment`): boto3 (the workdir
lock's conditional writes) and s3fs read AWS_ENDPOINT_URL and the usual credential variables. moto keeps objects in
memory; it honours `If-None-Match: *` and `If-Match` on writes and deletes, which the lock is built from.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import urllib.request

from tests.gcs_server import free_port, start_and_wait


class S3Server:
    """moto's S3 server; `environment` is what a process needs to talk to it."""

    def __init__(self):
        self.port = free_port()
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def environment(self) -> dict[str, str]:
        return {"AWS_ENDPOINT_URL": self.url, "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
                "AWS_DEFAULT_REGION": "us-east-1"}

    def start(self) -> S3Server:
        self.process = start_and_wait([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                                      f"{self.url}/moto-api/", "moto's S3 server", timeout_s=30)
        return self

    def make_bucket(self, name: str) -> str:
        """Creates bucket `name`; returns `s3://name`."""
        urllib.request.urlopen(urllib.request.Request(f"{self.url}/{name}", method="PUT"), timeout=10)
        return f"s3://{name}"

    def pause(self) -> None:
        """Every request from now on hangs (connections are accepted, nothing comes back), as a stalled store."""
        os.kill(self.process.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.process.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.kill()
            self.process.wait()
