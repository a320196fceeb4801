"""The GPU engine benchmark runs end to end on CPU (a smoke run on a tiny random shape), so a GPU
session spends its device time measuring, not debugging the script."""

from __future__ import annotations

from benchmarks import gpu_engine


def test_smoke_run_on_cpu_writes_a_row_per_system(tmp_path, default_model_dir):
    results = gpu_engine.main([
        "--device", "cpu", "--shapes", "tiny", "--requests", "2", "--runs", "1",
        "--max-tokens-cap", "8", "--dtype", "float32", "--systems", "ours_eager,hf_static",
        "--tokenizer", str(default_model_dir), "--checkpoints", str(tmp_path),
        "--json", str(tmp_path / "out.json")])
    assert results["tiny/ours_eager"]["tok_s"] > 0 and results["tiny/hf_static"]["tok_s"] > 0
    assert len(results["tiny/ours_eager"]["seconds"]) == 1
    assert (tmp_path / "out.json").is_file()
    table = gpu_engine.markdown(results)
    assert "| tiny | ours_eager |" in table and "| tiny | hf_static |" in table


def test_busy_time_is_the_union_of_kernel_intervals():
    assert gpu_engine.union_length([]) == 0.0
    # overlapping, nested, touching and apart; unsorted
    spans = [(10.0, 14.0), (0.0, 5.0), (3.0, 8.0), (4.0, 6.0), (14.0, 15.0), (20.0, 21.5)]
    assert gpu_engine.union_length(spans) == 8.0 + 5.0 + 1.5


def test_the_busy_cell_shows_the_unprofiled_share_where_there_is_one():
    assert gpu_engine.busy_cell({}) == "-"
    assert gpu_engine.busy_cell({"busy_share": 0.705}) == "70%"
    assert gpu_engine.busy_cell({"busy_share": 0.705, "busy_share_unprofiled": 0.9}) == \
        "70% (~90% unprofiled)"
