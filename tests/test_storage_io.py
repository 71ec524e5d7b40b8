"""Corpora, evaluation, export, the sweep and the curves with their paths in a bucket (the suite's GCS server,
`bucket`; eval, export and the sweep also against its S3 server, `store`): each reads and writes there what it reads
and writes in local folders, and a bucket that does not exist is one line naming it.

One micro run is trained locally per module; `storage.upload_tree` copies it into each test's bucket.
"""

import json
import subprocess
import sys

import numpy as np
import pytest

import train
from configs.sweeps import ablation
from deberta_jax import storage
from deberta_jax.data import packing, text
from deberta_jax.data.tokenizer import train_tokenizer
from deberta_jax.export import writer
from deberta_jax.study import curves, length_study, report, seed_rate, sweep
from tests import helpers

STEPS = 4


@pytest.fixture(scope="module")
def local_run(cache, tmp_path_factory):
    config = helpers.micro_config(cache, num_steps=STEPS, eval_every=STEPS, checkpoint_every=STEPS)
    workdir = tmp_path_factory.mktemp("local") / "run-s0"
    train.train_and_evaluate(config, workdir)
    return workdir


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A small text corpus in the micro run's vocabulary (synthetic markov documents, a blank line between)."""
    root = tmp_path_factory.mktemp("corpus")
    documents = text.load_documents("synthetic:markov:test:docs=4,doc_len=200")
    (root / "corpus").mkdir()
    (root / "corpus" / "test.txt").write_text("\n\n".join(documents) + "\n")
    return root / "corpus"


def test_corpus_globs_in_a_bucket_read_as_local_files_and_key_the_cache_by_generation(tmp_path, bucket, monkeypatch):
    local = tmp_path / "corpus"
    # "a-b/" sorts before "a/" as a string but after it as a path: the order must be the local glob's.
    files = {"a/x.txt": "one two three\nfour\n\nfive\n", "a-b/y.txt": "five six\n", "c.txt": "seven\n\neight nine\n"}
    for name, content in files.items():
        (local / name).parent.mkdir(parents=True, exist_ok=True)
        (local / name).write_text(content)
    storage.upload_tree(local, f"{bucket}/corpus")
    local_spec, remote_spec = f"{local}/**/*.txt", f"{bucket}/corpus/**/*.txt"

    remote_files = text.resolve_files(remote_spec)
    assert [str(p) for p in remote_files] == [str(p).replace(str(local), f"{bucket}/corpus")
                                              for p in text.resolve_files(local_spec)]
    assert text.load_documents(remote_spec) == text.load_documents(local_spec)
    # The local key is what it always was: the JSON of [resolved path, size, mtime_ns] per file.
    assert json.dumps(packing.source_fingerprint(local_spec)) == json.dumps(
        [[str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns] for p in text.resolve_files(local_spec)])

    tokenizer = train_tokenizer(text.load_documents(local_spec), vocab_size=60)
    before = packing.source_fingerprint(remote_spec)
    assert [entry[0] for entry in before] == [str(p) for p in remote_files]
    key = packing.cache_path(remote_spec, tokenizer, tmp_path / "cache")
    assert packing.cache_path(remote_spec, tokenizer, tmp_path / "cache") == key  # nothing written: the same key
    # By content, the bucket's stored MD5 is the one the local bytes give, and the same bytes written again (a new
    # generation) keep it.
    by_content = packing.source_fingerprint(remote_spec, by_content=True)
    assert by_content == [storage.checksum(local / name, "md5") for name in ("a/x.txt", "a-b/y.txt", "c.txt")]
    storage.write_text(f"{bucket}/corpus/c.txt", files["c.txt"])
    assert packing.source_fingerprint(remote_spec) != before
    assert packing.source_fingerprint(remote_spec, by_content=True) == by_content
    before = packing.source_fingerprint(remote_spec)
    storage.write_text(f"{bucket}/corpus/c.txt", files["c.txt"].replace("seven", "SEVEN"))  # the same size
    after = packing.source_fingerprint(remote_spec)
    assert after[:2] == before[:2] and after[2][:2] == before[2][:2] and after[2] != before[2]
    assert packing.cache_path(remote_spec, tokenizer, tmp_path / "cache") != key
    assert packing.source_fingerprint(remote_spec, by_content=True)[2] != by_content[2]

    with pytest.raises(FileNotFoundError, match=f"{bucket}/corpus/none/\\*.txt: glob matched no files"):
        text.resolve_files(f"{bucket}/corpus/none/*.txt")
    # Lines are read one at a time from the bucket, with their length bounded as for a local file.
    monkeypatch.setattr(text, "MAX_LINE_BYTES", 8)
    with pytest.raises(ValueError, match=f"{bucket}/corpus/a/x.txt has a line of more than"):
        text.load_documents(f"{bucket}/corpus/a/x.txt")


def eval_py(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "eval.py", *args], cwd=helpers.REPO, capture_output=True, text=True,
                          timeout=300)


def test_eval_reads_a_workdir_and_data_in_a_bucket_and_writes_its_report_there(local_run, corpus, store, tmp_path):
    bucket = store[1]
    storage.upload_tree(local_run, f"{bucket}/runs/run-s0")
    storage.upload_tree(corpus, f"{bucket}/data/corpus")
    common = ["--multiples", "1", "--extra", "", "--protocols", "chunked", "--methods", "", "--bootstrap", "20"]
    local = eval_py("--workdir", str(local_run), "--data_files", str(corpus / "test.txt"),
                    "--out", str(tmp_path / "out"), *common)
    assert local.returncode == 0, local.stderr[-2000:]
    remote = eval_py("--workdir", f"{bucket}/runs/run-s0", "--data_files", f"{bucket}/data/corpus/test.txt",
                     "--out", f"{bucket}/results", *common)
    assert remote.returncode == 0, remote.stderr[-2000:]

    def records(where):  # the workdir's path is the one field that names where it was read
        return [{k: v for k, v in r.items() if k != "source"} for r in report.read_results_file(where)["records"]]

    assert records(f"{bucket}/results") == records(tmp_path / "out")
    assert {r["model"] for r in records(f"{bucket}/results")} == {"run", "unigram"}
    assert {r["dataset"] for r in records(f"{bucket}/results")} == {"corpus/test"}
    assert storage.read_text(f"{bucket}/results/summary.md") == (tmp_path / "out" / "summary.md").read_text()
    assert sorted(storage.path(f"{bucket}/results").iterdir()) == sorted(
        storage.path(f"{bucket}/results") / p.name for p in (tmp_path / "out").iterdir())
    assert report.load_results(f"{bucket}/results")["source"].str.startswith(f"{bucket}/runs/run-s0").any()


@pytest.mark.filterwarnings("ignore::deberta_jax.model.hf.ExportWarning")  # the clamp's, returned as notes too
def test_export_from_a_bucket_to_a_bucket_writes_the_files_of_a_local_export(local_run, store, tmp_path):
    bucket = store[1]
    storage.upload_tree(local_run, f"{bucket}/run")
    notes = writer.export_workdir(local_run, tmp_path / "export")
    assert writer.export_workdir(f"{bucket}/run", f"{bucket}/export") == notes
    assert {name: storage.read_bytes(f"{bucket}/export/{name}") for name in writer.EXPORTED_FILES} == {
        name: (tmp_path / "export" / name).read_bytes() for name in writer.EXPORTED_FILES}
    assert sorted(p.name for p in storage.path(f"{bucket}/export").iterdir()) == sorted(writer.EXPORTED_FILES)
    # The bucket's export is a checkpoint eval.py reads (--hf_checkpoint), under the folder's name.
    remote, local = (length_study.load_hf_checkpoint(p) for p in (f"{bucket}/export", str(tmp_path / "export")))
    assert (remote.label, remote.source) == ("export", f"{bucket}/export")
    assert remote.tokenizer.to_str() == local.tokenizer.to_str() and remote.model.cfg == local.model.cfg
    assert helpers.model_params(remote.model).keys() == helpers.model_params(local.model).keys()
    for name, value in helpers.model_params(local.model).items():
        np.testing.assert_array_equal(helpers.model_params(remote.model)[name], value)
    # An export into a folder holding another checkpoint's files is refused there too.
    storage.write_bytes(f"{bucket}/other/pytorch_model.bin", b"")
    with pytest.raises(FileExistsError, match="pytorch_model.bin"):
        writer.export_workdir(f"{bucket}/run", f"{bucket}/other")


def test_a_bucket_that_does_not_exist_is_one_line_naming_it(local_run, gcs):
    missing = "gs://no-such-bucket-for-out"
    result = eval_py("--workdir", str(local_run), "--data_files", "synthetic:markov:test", "--out", f"{missing}/out")
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and missing in result.stderr, result.stderr
    with pytest.raises(storage.StorageError, match=f"--out {missing}/export is not writable: {missing}: no") as err:
        writer.export_workdir(local_run, f"{missing}/export")
    assert "\n" not in str(err.value)


def test_a_sweep_reads_its_runs_and_data_in_a_bucket_and_reports_there(local_run, corpus, store, monkeypatch):
    """The sweep's report (`--mode report`) over a run in a bucket: evaluated once, its evaluation cached beside it
    in the bucket and read back by the next report."""
    bucket = store[1]
    storage.upload_tree(local_run, f"{bucket}/runs/run-s0")
    storage.upload_tree(corpus, f"{bucket}/data/corpus")
    plan = ablation.get_config("smoke")
    plan.config_path = "configs/sweeps/ablation.py:smoke"
    plan.workdir_root, plan.report_dir, plan.data_dir = f"{bucket}/runs", f"{bucket}/report", f"{bucket}/data"
    plan.eval.data_files = {"corpus/test": f"{plan.data_dir}/corpus/test.txt"}
    plan.eval.update(multiples=[1], extra=[], protocols=["chunked"], methods=[], bootstrap=20)
    runs = [dict(name="run-s0", workdir=f"{bucket}/runs/run-s0", command=["python", "train.py"], num_steps=STEPS),
            dict(name="unfinished-s0", workdir=f"{bucket}/runs/unfinished-s0", command=["python", "train.py"],
                 num_steps=STEPS)]
    assert sweep.finished(runs[0]) and not sweep.finished(runs[1])
    # The run is the micro one the fixture trained, not the smoke sweep's: this test is about the bucket, and
    # tests/study/test_sweep.py checks that a sweep refuses runs trained on another config.
    monkeypatch.setattr(sweep, "changed_since_trained", lambda run: None)
    report_path = sweep.evaluate_and_report(plan, runs, "report")
    assert report_path == f"{bucket}/report/REPORT.md"
    assert "missing: unfinished-s0" in storage.read_text(report_path) and "| run |" in storage.read_text(report_path)
    assert storage.path(f"{bucket}/runs/run-s0/{sweep.EVAL_CACHE}").is_file()
    assert {r["model"] for r in report.read_results_file(f"{bucket}/report")["records"]} == {"run", "unigram"}

    def fail(*args, **kwargs):
        raise AssertionError("evaluated again")

    monkeypatch.setattr(sweep.length_study, "run_study", fail)
    sweep.evaluate_and_report(plan, runs, "report")  # every evaluation read back from the bucket
    # The same bytes written again (a new generation) keep the evaluations; other bytes do not.
    storage.write_text(f"{bucket}/data/corpus/test.txt", (corpus / "test.txt").read_text())
    sweep.evaluate_and_report(plan, runs, "report")
    storage.write_text(f"{bucket}/data/corpus/test.txt", (corpus / "test.txt").read_text() + "\none more line\n")
    with pytest.raises(AssertionError, match="evaluated again"):
        sweep.evaluate_and_report(plan, runs, "report")


def test_curves_and_seed_rate_read_runs_in_a_bucket_and_write_there(local_run, bucket):
    storage.upload_tree(local_run, f"{bucket}/runs/run-s0")
    run = f"{bucket}/runs/run-s0"
    curves.write_curves_report({"bert": run, "nope": run}, f"{bucket}/curves", margin=0.05)
    saved = json.loads(storage.read_text(f"{bucket}/curves/curves.json"))
    exit_step = curves.plateau_exit(curves.eval_curve(run), saved["unigram_floor"], 0.05)  # the curve read remotely
    assert saved["curves"]["bert"] == {str(s): v for s, v in curves.eval_curve(str(local_run)).items()}
    assert saved["exits"] == {"bert": exit_step, "nope": exit_step} and saved["workdirs"]["bert"] == run
    markdown = seed_rate.write_rate_report([f"{bucket}/curves/curves.json"], "bert", "nope", f"{bucket}/rate")
    assert "**0 of 1 seeds**" in markdown and storage.read_text(f"{bucket}/rate/rate.md") == markdown
    assert sorted(p.name for p in storage.path(f"{bucket}/rate").iterdir()) == ["gap_vs_step.png", "rate.json",
                                                                                 "rate.md"]
    assert storage.read_bytes(f"{bucket}/curves/eval_loss_vs_step.png").startswith(b"\x89PNG")


@pytest.mark.parametrize("upload", [True, False])
def test_metrics_in_a_bucket_upload_their_last_events_on_close_unless_told_not_to(bucket, upload):
    """A run that ended on a storage failure closes its metrics with `upload=False`: the TensorBoard events written
    since the last upload stay local (a call to a failed store would only fail again), while a normal close sends
    them up."""
    from deberta_jax.train import metrics_io

    writer = metrics_io.MetricsWriter(f"{bucket}/run", resume_step=0)
    writer.write(1, {"loss": 2.0})
    events = f"{bucket}/run/{metrics_io.TENSORBOARD_DIR}"
    uploaded = storage.fingerprints(events)
    writer.tensorboard.add_scalar("loss", 1.5, 2)  # written locally, not yet uploaded
    writer.close(upload=upload)
    assert (storage.fingerprints(events) != uploaded) == upload


def test_the_gcs_server_restarted_after_a_torn_upload_lists_the_bucket_without_it(gcs, bucket):
    """The fault tests kill the suite's GCS server inside saves. GCS shows an upload whole or not at all; the emulator
    can be killed between an object's bytes and its metadata, and must then come back listing every whole object and
    not the torn one (it would otherwise fail every listing of that bucket, and the run would seem to have none)."""
    storage.write_text(f"{bucket}/run/whole.txt", "kept")
    folder = gcs.root / bucket.removeprefix("gs://") / "run"
    (folder / "torn.bin").write_bytes(b"bytes whose metadata the kill prevented")
    (folder / ".whole.txt1234").write_bytes(b"a temporary file the kill left before its rename")
    gcs.kill()
    gcs.start()
    assert [p.name for p in storage.path(f"{bucket}/run").iterdir()] == ["whole.txt"]
    assert storage.read_text(f"{bucket}/run/whole.txt") == "kept"
