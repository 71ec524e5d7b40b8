"""`atomic.write_text`: a write that fails part-way through leaves the previous content and no temporary behind."""

import subprocess
import sys
import textwrap

import pytest

from deberta_jax.storage import atomic
from tests.helpers import REPO

OLD = "the previous content\n"


def test_a_complete_write_replaces_the_content_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "out.json"
    path.write_text(OLD)
    atomic.write_text(path, "new\n")
    assert path.read_text() == "new\n"
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]


def test_a_text_that_fails_to_encode_part_way_leaves_the_previous_content(tmp_path):
    """Many valid characters, then a lone surrogate no encoder writes: writing in place would already have
    truncated the file when the error comes."""
    path = tmp_path / "out.json"
    path.write_text(OLD)
    with pytest.raises(UnicodeEncodeError):
        atomic.write_text(path, "x" * 100_000 + "\ud800")
    assert path.read_text() == OLD
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]


def test_a_full_disk_part_way_leaves_the_previous_content(tmp_path):
    """A file-size limit (RLIMIT_FSIZE, in a process of its own) stops the write with EFBIG after its first 4 KiB
    reached the disk: a full disk, cheaply. The old file (smaller than the limit) must survive, and the new one's
    temporary must be gone."""
    path = tmp_path / "out.json"
    path.write_text(OLD)
    script = textwrap.dedent(f"""
        import errno, resource, signal
        from deberta_jax.storage import atomic
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead of killing the process
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
        try:
            atomic.write_text({str(path)!r}, "y" * 1_000_000)
        except OSError as e:
            assert e.errno == errno.EFBIG, e
            print("failed part-way")
    """)
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "failed part-way"
    assert path.read_text() == OLD
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]


def test_a_failed_first_write_leaves_no_file(tmp_path):
    path = tmp_path / "out.json"
    with pytest.raises(UnicodeEncodeError):
        atomic.write_text(path, "x" * 1000 + "\ud800")
    assert list(tmp_path.iterdir()) == []
