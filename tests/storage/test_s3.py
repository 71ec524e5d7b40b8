"""s3:// against a real S3 API server the suite starts (moto's, `tests.s3_server`): the workdir lock by S3's conditional
writes (and a store that ignores them refused), whole files, listings and checksums; a missing s3fs named with its
install command. Training, resuming and the faults of a workdir in s3:// are in tests/train/test_pod.py; eval,
export and the sweep reading one in tests/test_storage_io.py."""

import json
import logging
import os
import subprocess
import sys
import time

import pytest

from deberta_jax import storage
from deberta_jax.storage import paths
from deberta_jax.train import metrics_io, workdir_lock
from tests.helpers import REPO, run_with_store_paused


def test_the_s3_lock_refuses_a_second_run_renews_keeps_its_own_late_write_and_is_taken_over_when_stale(s3_bucket,
                                                                                                      caplog):
    workdir, lock = f"{s3_bucket}/run", f"{s3_bucket}/run/{workdir_lock.LOCK_FILE}"
    with caplog.at_level(logging.WARNING), workdir_lock.hold(workdir, what="the first run", renew_every_s=0.2,
                                                              stale_after_s=5) as holding:
        versions, deadline = set(), time.monotonic() + 1.2
        while time.monotonic() < deadline:
            versions.add(storage.read_version(lock).generation)
            time.sleep(0.05)
        assert len(versions) >= 3, versions  # taken, then renewed at least twice (each renewal a new ETag)
        with pytest.raises(workdir_lock.WorkdirBusyError, match="in use by PID .* the first run"):
            with workdir_lock.hold(workdir):
                pass
        # The late copy of a renewal, with different content (its time) and so a new ETag, between two renewals.
        while True:  # a renewal may come between the read and the write
            current = storage.read_version(lock)
            late = json.dumps(dict(json.loads(current.data), renewed=0)).encode()
            if storage.replace_version(lock, late, current.generation):
                break
        time.sleep(0.6)
        holding.check()
    assert "landed late" in caplog.text and "taken over" not in caplog.text
    assert not storage.path(lock).exists()
    # A holder on another host that stopped renewing: refused while fresh, taken over once silent long enough (S3's
    # update times have whole seconds).
    other = dict(pid=1, host="another-vm", since=time.time(), what="train.py")
    assert storage.create_new(lock, json.dumps(other).encode())
    assert storage.create_new(lock, b"{}") is None
    with pytest.raises(workdir_lock.WorkdirBusyError, match="PID 1 on another-vm"):
        with workdir_lock.hold(workdir, stale_after_s=60):
            pass
    time.sleep(2.5)
    with workdir_lock.hold(workdir, stale_after_s=1) as holding:
        assert json.loads(storage.read_text(lock))["pid"] == os.getpid()
        # Taken over in turn while this holder stalled: it writes nothing more.
        current = storage.read_version(lock)
        assert not storage.delete_version(lock, storage.other_version(current.generation))
        assert storage.delete_version(lock, current.generation)
        assert storage.create_new(lock, json.dumps(other).encode())
        time.sleep(0.6)
        with pytest.raises(workdir_lock.WorkdirBusyError, match="was taken over by another run"):
            storage.write_text(f"{workdir}/metrics.jsonl", "")
    assert json.loads(storage.read_text(lock))["host"] == "another-vm"


def test_s3_files_listings_checksums_and_a_workdirs_records_read_as_locally(s3_bucket, tmp_path):
    workdir = f"{s3_bucket}/run"
    storage.check_writable(workdir, "--workdir")
    storage.write_text(f"{workdir}/{metrics_io.METRICS_FILE}", '{"step": 1, "loss": 2.5}\n{"step": 2, "loss": 2.')
    assert metrics_io.read_metrics(workdir) == [{"step": 1, "loss": 2.5}]  # a torn last line is left out
    (tmp_path / "local" / "sub").mkdir(parents=True)
    (tmp_path / "local" / "sub" / "a.txt").write_text("a")
    (tmp_path / "local" / "b.txt").write_text("b")
    storage.upload_tree(tmp_path / "local", f"{s3_bucket}/tree")
    assert storage.glob(f"{s3_bucket}/tree/**/*.txt") == [f"{s3_bucket}/tree/b.txt", f"{s3_bucket}/tree/sub/a.txt"]
    assert storage.fingerprints(f"{s3_bucket}/tree") == storage.fingerprints(tmp_path / "local", kind="md5")
    with storage.local_copy(f"{s3_bucket}/tree") as local:
        assert (local / "sub" / "a.txt").read_text() == "a"
    storage.move_tree(f"{s3_bucket}/tree", f"{s3_bucket}/moved")
    assert storage.read_text(f"{s3_bucket}/moved/b.txt") == "b" and not storage.path(f"{s3_bucket}/tree").exists()


def test_a_corpus_read_from_a_store_that_stops_answering_ends_in_one_line_past_the_deadline(s3, s3_bucket):
    """The store stops answering in the middle of a corpus (SIGSTOP of the server, after the reader's first block):
    the reading process ends within seconds of its 2 s deadline with one line naming the read and the store, instead
    of waiting on the connection."""
    corpus = f"{s3_bucket}/corpus.txt"
    storage.write_text(corpus, "word " * (64 * 2**20 // 5))  # past a block of the client's reads (50 MiB)
    # The 2 s limit from the second read on: the first fetches a whole block, which a busy machine may take longer
    # than that to move even from a store that answers.
    program = ("import sys\nfrom deberta_jax import storage\nfrom deberta_jax.storage import deadlines\n"
               "with storage.reader(sys.argv[1]) as f:\n    f.read(1)\n"
               "    deadlines.set_limit(2, 'reader', '--storage_deadline_s')\n    print('reading', flush=True)\n"
               "    sys.stdin.readline()\n    while f.read(2**20):\n        pass\nprint('read all')\n")
    reader = subprocess.Popen([sys.executable, "-c", program, corpus], cwd=REPO, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(os.environ))
    out, err, took = run_with_store_paused(reader, s3, "reading")
    lines = [line for line in err.splitlines() if line.strip()]
    assert reader.returncode == 1 and "read all" not in out and took < 15, (took, err[-2000:])
    assert lines == [f"reader: read {corpus} did not finish within 2 s: {s3_bucket} is not answering. Stopped; what "
                     "was saved before it is intact, so rerun the same command to resume; --storage_deadline_s sets "
                     "the limit"], err[-2000:]


def test_an_s3_store_that_ignores_conditional_writes_is_refused_in_one_line(s3, s3_bucket, tmp_path):
    """An S3-compatible store that carries out writes whatever their `If-Match` / `If-None-Match` would let two runs
    hold one lock: train.py is refused when it takes the lock, before anything is compiled, in one line naming the
    store, and leaves no lock behind."""
    from tests.store_proxy import StoreProxy

    with StoreProxy(s3.url, "preconditions") as proxy:
        result = subprocess.run(
            [sys.executable, "train.py", "--config", "configs/deberta.py:micro", "--workdir", f"{s3_bucket}/run",
             "--config.data.train_files=synthetic:markov:train", f"--config.data.cache_dir={tmp_path}"],
            cwd=REPO, capture_output=True, text=True, timeout=120,
            env=dict(os.environ, JAX_PLATFORMS="cpu", AWS_ENDPOINT_URL=proxy.url))
    assert result.returncode == 1, result.stderr[-2000:]
    assert "Traceback" not in result.stderr and "model:" not in result.stderr, result.stderr[-2000:]
    assert result.stderr.splitlines()[-2].startswith(f"train.py: {s3_bucket}: this store ignores generation "
                                                     "preconditions"), result.stderr[-2000:]
    assert storage.read_version(f"{s3_bucket}/run/{workdir_lock.LOCK_FILE}") is None


def test_s3_without_s3fs_is_one_line_with_the_install_command(monkeypatch):
    monkeypatch.setattr(paths, "_installed", lambda module: module != "s3fs")
    with pytest.raises(storage.StorageError, match=r"^s3://b/run: s3:// paths need s3fs, which is not installed "
                                                   r"here: pip install s3fs$"):
        storage.path("s3://b/run")
