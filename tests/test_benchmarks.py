"""The benchmark scripts run end to end on a micro model and report what their docstrings promise;
the FLOP count behind MFU matches the conventional figure for BERT tiny at length 128 (head at every position)."""

import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import train_step  # noqa: E402


def run_script(name: str, *args: str) -> str:
    result = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", name), *args], capture_output=True,
                            text=True, timeout=900, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_flops_per_token_of_bert_tiny():
    cfg, _ = train_step.model_config("bert", "tiny", 128, None, "dense", 512)
    # Forward + backward with the head at every position: the conventional "about 33 MFLOP per token".
    assert 3 * train_step.model_flops_per_token(cfg, 128, 16, head_everywhere=True) == pytest.approx(33.4e6, rel=0.01)
    # Our step scores only the masked positions' budget (about a quarter of them).
    assert 3 * train_step.model_flops_per_token(cfg, 128, 16) == pytest.approx(23.7e6, rel=0.01)
    deberta, _ = train_step.model_config("deberta", "tiny", 128, None, "dense", 512)
    assert train_step.model_flops_per_token(deberta, 128, 16) > train_step.model_flops_per_token(cfg, 128, 16)


@pytest.mark.slow  # runs the script end to end
@pytest.mark.long
def test_train_step_benchmark_prints_a_json_line_per_case_with_the_torch_comparison():
    out = run_script("train_step.py", "--model", "bert,deberta", "--size", "micro", "--seq", "32", "--batch", "2",
                     "--warmup", "0", "--steps", "1", "--compare-transformers")
    rows = [json.loads(line) for line in out.splitlines()]
    assert [row["model"] for row in rows] == ["bert", "deberta"]
    for row in rows:
        assert row["tokens_per_s"] > 0 and row["torch_tokens_per_s"] > 0 and row["memory_mb"] > 0
        assert row["speedup_vs_torch"] == pytest.approx(row["tokens_per_s"] / row["torch_tokens_per_s"], rel=1e-2)
        assert 0 < row["mfu"] <= row["mfu_head_everywhere"]


@pytest.mark.slow  # runs the script end to end
def test_profile_step_attributes_the_step_to_categories():
    out = run_script("profile_step.py", "--model", "deberta", "--size", "micro", "--seq", "32", "--batch", "2",
                     "--steps", "1", "--top", "1")
    total = float(out.split("ms of XLA ops per step")[0].split(":")[-1])
    rows = [re.match(r"^  (\S.*?)\s+([\d.]+) ms\s+[\d.]+%", line) for line in out.splitlines()]
    shares = {row.group(1): float(row.group(2)) for row in rows if row}
    assert {"matmul", "gather", "scatter"} <= set(shares)  # DeBERTa's c2p/p2c gathers and their gradients
    # Every figure is printed to 0.1 ms: the categories add up to the total within their rounding.
    assert shares["matmul"] > 0 and sum(shares.values()) == pytest.approx(total, abs=0.05 * (len(shares) + 1))


def test_hlo_fingerprint_ignores_names_and_metadata_not_the_program():
    import hlo_fingerprint
    program = """HloModule jit_step, entry_computation_layout={(f32[4]{0})->f32[4]{0}}
%region_0.1 (a.2: f32[4]) -> f32[4] {
  %a.2 = f32[4]{0} parameter(0)
  ROOT %add.3 = f32[4]{0} add(%a.2, %a.2), metadata={op_name="jit(step)/add" source_file="/x/old/model.py"}
}
FileNames
1 "/x/old/model.py"
StackFrames
1 {file_location_id=1 parent_frame_id=1}
"""
    renamed = (program.replace("%add.3", "%add.17").replace("/x/old/", "/y/new/").replace("region_0.1", "region_4.2")
               .replace("1 {file_location_id=1", "2 {file_location_id=3"))
    assert hlo_fingerprint.structure(renamed) == hlo_fingerprint.structure(program)
    for changed in (program.replace(" add(", " multiply("), program.replace("f32[4]{0} add", "f32[8]{0} add")):
        assert hlo_fingerprint.structure(changed) != hlo_fingerprint.structure(program)


@pytest.mark.slow  # compiles for a TPU chip (libtpu)
def test_tpu_attention_benchmark_compiles_the_fused_kernels(tmp_path):
    out = tmp_path / "attention.json"
    run_script("tpu_attention.py", "--lengths", "256", "--tokens", "512", "--only", "fused", "--out", str(out))
    rows = {row["program"]: row for row in json.loads(out.read_text())}
    assert set(rows) == {"DeBERTa, fused TPU kernel", "BERT, fused TPU kernel"}
    deberta, bert = rows["DeBERTa, fused TPU kernel"], rows["BERT, fused TPU kernel"]
    assert deberta["rows"] == 2 and deberta["hbm_gib"] > 0 and deberta["roofline_ms"] > 0
    # The kernels' cost estimates reach XLA's analysis: DeBERTa's position products cost more than BERT's tile.
    assert deberta["gflops"] > 2 * bert["gflops"] > 0
    assert deberta["gathers"] <= 2 and bert["gathers"] == 0  # only the per-distance table expansions


def test_checkpoint_storage_benchmark_times_the_same_checkpoint_on_disk_and_in_both_buckets():
    """Against the GCS and S3 servers the script starts itself: one line per store, the same checkpoint in each."""
    out = run_script("checkpoint_storage.py", "--sizes", "micro", "--rounds", "1", "--every", "1", "--batch", "2")
    rows = [json.loads(line) for line in out.splitlines()]
    assert [(row["size"], row["storage"]) for row in rows] == [("micro", "local"), ("micro", "gs"), ("micro", "s3")]
    local, gs, s3 = rows
    assert gs["where"].startswith("gs://") and s3["where"].startswith("s3://")
    # The same arrays in each place. A micro checkpoint is half a megabyte, so the files that differ by storage
    # (orbax's commit markers in a bucket, the digest record's SHA-256 hex or MD5 base64) weigh a few percent.
    for remote in (gs, s3):
        assert remote["checkpoint_mb"] == pytest.approx(local["checkpoint_mb"], rel=0.1) and local["checkpoint_mb"] > 0
    for row in rows:
        assert row["save_s"] > 0 and row["restore_s"] > 0 and row["step_s_checkpoint_every_1"] > row["step_s"] > 0
