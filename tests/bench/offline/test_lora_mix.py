"""`bench throughput --lora-adapters`: the cost of adapters as a ratio to the base model, in one run."""

import json

from services.commands.cli import main


def test_adapter_counts_run_forward_and_back_with_ratios_to_the_base(tiny_llama_dir, tmp_path, capsys):
    out = tmp_path / "lora.json"
    rc = main(["bench", "throughput", "--model", str(tiny_llama_dir), "--dtype", "float32", "--workload", "w1",
               "--scale", "0.02", "--lora-adapters", "0,2", "--lora-passes", "3", "--json", str(out)])
    assert rc == 0
    results = {r["adapters"]: r for r in json.loads(out.read_text())["lora_results"]}
    assert set(results) == {0, 2}
    assert results[0]["ratio_to_base"] == 1.0 and results[2]["ratio_to_base"] > 0
    assert results[0]["cpu_ratio_to_base"] == 1.0 and results[2]["cpu_ratio_to_base"] > 0
    for r in results.values():  # in order, reversed, in order
        assert len(r["runs_tokens_per_s"]) == len(r["runs_cpu_ms_per_token"]) == 3 and r["output_tokens"] > 0
        assert abs(r["cpu_ms_per_token"] - sorted(r["runs_cpu_ms_per_token"])[1]) < 1e-3  # the median
    assert "adapters in the mix" in capsys.readouterr().out


def test_a_bad_count_is_refused(tiny_llama_dir):
    assert main(["bench", "throughput", "--model", str(tiny_llama_dir), "--lora-adapters", "0,x"]) == 2
    assert main(["bench", "throughput", "--model", str(tiny_llama_dir), "--lora-adapters=-1,0"]) == 2
    assert main(["bench", "throughput", "--model", str(tiny_llama_dir), "--lora-adapters", "0,1",
                 "--lora-passes", "0"]) == 2
