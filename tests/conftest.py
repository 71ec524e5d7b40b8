"""Suite-wide set-up: cheaper XLA compiles, and one persistent JAX compilation cache for every test process.

Most of the suite's time is XLA compiling small models for the CPU, not running them. Tests compile at
LLVM optimization level 0 (`--xla_backend_optimization_level=0`) and with XLA's older elemental emitters for
fusions (`--xla_cpu_use_fusion_emitters=false`), both set before any backend starts and inherited by
subprocesses: the same HLO and fusions, compiled in about a third of the time (the micro train step: 4.2 s of
CPU at level 0, 2.5 s without the fusion emitters), run somewhat slower, which tiny test models do not notice.

Dozens of tests train or evaluate the same micro models, in-process and through `train.py` / `eval.py`
subprocesses; each would compile the same train and eval steps again. JAX's persistent cache (keyed by the
computation, the devices and the compile options, so a cached executable is the one a fresh compile would
give) lets them load it instead. The cache lives under pytest's temporary root, shared by xdist workers: an
entry another worker is still writing reads as a miss (JAX warns and compiles), never as a wrong program.
"""

import os

# libtpu is installed for the TPU compiles of tests/aot/test_aot.py: without this, JAX would look for a TPU first.
# Parallel workers each load libtpu for those compiles, which it allows only when told to. The CUDA plugin
# (jax[cuda12], for the GPU compiles of tests/aot/test_aot_gpu.py) must not check the CUDA libraries against a
# driver when it loads: there is none here.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")

import jax  # noqa: E402 - after the platform is chosen
import pytest  # noqa: E402

os.environ["XLA_FLAGS"] = " ".join(filter(None, [os.environ.get("XLA_FLAGS"), "--xla_backend_optimization_level=0",
                                                  "--xla_cpu_use_fusion_emitters=false"]))


@pytest.fixture(scope="session", autouse=True)
def jax_compilation_cache(tmp_path_factory):
    root = tmp_path_factory.getbasetemp()  # per worker under xdist: .../pytest-N/popen-gwK
    cache = (root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root) / "jax-compilation-cache"
    cache.mkdir(parents=True, exist_ok=True)
    settings = {"jax_compilation_cache_dir": str(cache), "jax_persistent_cache_min_compile_time_secs": 0,
                "jax_persistent_cache_min_entry_size_bytes": 0}
    for name, value in settings.items():
        jax.config.update(name, value)
        os.environ[name.upper()] = str(value)  # subprocesses (train.py, eval.py) read the same cache
    return cache


@pytest.fixture
def no_persistent_cache():
    """For tests that compile for TPUs or GPUs this process lacks: the persistent compilation cache cannot hold
    their executables."""
    jax.config.update("jax_enable_compilation_cache", False)
    yield
    jax.config.update("jax_enable_compilation_cache", True)


def pytest_collection_modifyitems(items):
    """Tests marked `long` first (a stable sort): a worker that picks one up last would run on alone."""
    items.sort(key=lambda item: item.get_closest_marker("long") is None)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A packed-token cache shared by one module's short runs (`tests.helpers.micro_config`)."""
    return tmp_path_factory.mktemp("cache")


def _serving(server):
    """Runs `server` for this test process, which it and the processes it starts reach through the environment."""
    saved = {name: os.environ.get(name) for name in server.environment}
    os.environ.update(server.environment)
    yield server
    server.stop()
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def _bucket_name(request) -> str:
    """A new bucket's name, after the test."""
    import re
    import uuid

    return re.sub(r"[^a-z0-9]+", "-", request.node.name.lower())[:40].strip("-") + "-" + uuid.uuid4().hex[:6]


@pytest.fixture(scope="session")
def gcs(tmp_path_factory):
    """A real GCS API server (`tests.gcs_server`); each test makes its own bucket (`bucket`)."""
    from tests.gcs_server import GcsServer

    yield from _serving(GcsServer(tmp_path_factory.mktemp("gcs")).start())


@pytest.fixture
def bucket(gcs, request):
    """A new bucket on the suite's GCS server, `gs://<name>`, named after the test."""
    return gcs.make_bucket(_bucket_name(request))


@pytest.fixture(scope="session")
def s3():
    """A real S3 API server (`tests.s3_server`); each test makes its own bucket (`s3_bucket`)."""
    from tests.s3_server import S3Server

    yield from _serving(S3Server().start())


@pytest.fixture
def s3_bucket(s3, request):
    """A new bucket on the suite's S3 server, `s3://<name>`, named after the test."""
    return s3.make_bucket(_bucket_name(request))


@pytest.fixture(params=["gs", "s3"])
def store(request):
    """`(server, new bucket)` for each object store a workdir can live in: a test taking it runs once against the
    suite's GCS server and once against its S3 server, which hold checkpoints in different ways (orbax writes to
    gs:// itself; s3:// checkpoints are staged locally and published)."""
    if request.param == "gs":
        return request.getfixturevalue("gcs"), request.getfixturevalue("bucket")
    return request.getfixturevalue("s3"), request.getfixturevalue("s3_bucket")
