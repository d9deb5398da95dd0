"""Issue 36 item 1: ``pipepool bench --cpu-peers`` times the engine against sentence-transformers
and ONNX Runtime (fp32, dynamic int8) on the same texts and weights, and every system's vectors
are the model's: the fp32 ones agree with sentence-transformers fp32 per text."""

from __future__ import annotations

import json

import pytest

from pipepool.commands.cli import main

pytest.importorskip("onnx", reason="needs the bench-cpu extra (onnx); CI does not install it")
pytest.importorskip("onnxscript", reason="needs the bench-cpu extra (onnxscript)")
pytest.importorskip("onnxruntime", reason="needs the bench-cpu extra (onnxruntime)")

SYSTEMS = ["pipepool float32", "sentence-transformers", "onnxruntime fp32", "onnxruntime int8"]


# The decoder's export takes as long again (torch.export traces a second model): slow.
@pytest.mark.parametrize(
    "model", ["st_bert_path", pytest.param("qwen3_path", marks=pytest.mark.slow)]
)
def test_cpu_peers_every_fp32_system_matches_sentence_transformers(model, request, tmp_path):
    """A sentence-transformers folder (mean pooling, Dense, Normalize) and a plain decoder
    folder (last-token pooling, as the engine pools it), 8 texts, one round."""
    rows_file = tmp_path / "rows.json"
    args = ["bench", "--cpu-peers", "--model", str(request.getfixturevalue(model))]
    args += ["--workload", "T5", "--requests", "8", "--passes", "1", "--threads", "1"]
    args += ["--peer-batch-sizes", "4", "--json", str(rows_file)]
    assert main(args) == 0
    [row] = json.loads(rows_file.read_text())
    assert (row["workload"], row["texts"], row["rounds"], row["threads"]) == ("T5", 8, 1, 1)
    systems = {s["system"]: s for s in row["systems"]}
    assert list(systems) == SYSTEMS
    for name in SYSTEMS[:3]:
        assert systems[name]["min_cosine_vs_st_fp32"] >= 0.9999, (name, systems[name])
    # int8 weights on a tiny random model: close, not equal (it is a quality column, reported).
    assert systems["onnxruntime int8"]["mean_cosine_vs_st_fp32"] >= 0.9, systems
    assert systems["pipepool float32"]["pipepool_ratio"] == 1.0
    for s in systems.values():
        assert s["texts_per_s"] > 0 and len(s["texts_per_s_by_round"]) == 1
    assert [systems[n]["batch_size"] for n in SYSTEMS] == [None, 4, 4, 4]
    # The fp32 ceiling (commands/cpu_ceiling.py): every system's rate in model GFLOP/s beside it.
    bound = row["fp32_ceiling"]
    assert bound["texts_per_s"] > 0 and bound["gemm_gflops"] > 0
    assert bound["model_flops"] >= bound["linear_flops"] > 0
    for s in systems.values():
        expected = bound["model_flops"] / 1e9 / row["texts"] * s["texts_per_s"]
        assert abs(s["model_gflops"] - expected) <= 0.05 + 1e-3 * expected, s


def test_cpu_peers_refuses_token_id_workloads(capsys):
    assert main(["bench", "--cpu-peers", "--workload", "W1"]) == 2
    assert "--cpu-peers runs text workloads only" in capsys.readouterr().err


def test_cpu_peers_unknown_peer_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit:
        main(["bench", "--cpu-peers", "st,tensorrt"])
    assert exit.value.code == 2
    assert "unknown CPU peer 'tensorrt' (known: st, ort, ort-int8)" in capsys.readouterr().err
