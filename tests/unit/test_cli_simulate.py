import json

from pagoda.tools import simulate
from scheduler_svc import plan_capacity


def test_simulate_prints_the_textbook_figures(capsys):
    simulate.main(["--requests", "30"])
    out = capsys.readouterr().out
    assert "1,024 reserved slots for 480 useful tokens = 46.9%" in out
    assert "64 vs 30 (paged per sequence [2, 8, 4, 16]" in out
    assert "208 vs 13 shared + tails" in out
    assert "240 without prefix caching, 60 with it" in out
    rows = [line.split() for line in out.splitlines() if line.strip().split(" ")[0] in {"8", "16", "32", "64", "128"}]
    assert [row[0] for row in rows] == ["8", "16", "32", "64", "128"]
    unused = [float(row[1]) for row in rows]
    assert unused == sorted(unused) and unused[0] < unused[-1]  # bigger blocks waste more


def test_plan_capacity_figures(capsys):
    plan_capacity.main(["--num-layers", "32", "--num-kv-heads", "8", "--head-dim", "128", "--dtype", "float16",
                        "--block-size", "16", "--memory", "60GiB"])
    out = capsys.readouterr().out
    assert "bytes per block:  2,097,152" in out
    assert "number of blocks: 30,720" in out
    assert "max concurrent sequences at 2,048 tokens: 240" in out


def test_plan_capacity_reads_an_hf_config(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 64,
        "torch_dtype": "float32"}))
    plan_capacity.main(["--model", str(tmp_path), "--memory", "1MiB", "--block-size", "4", "--seq-len", "64"])
    out = capsys.readouterr().out
    assert "bytes per token:  512" in out  # 2 (K,V) x 2 layers x 2 heads x 16 dims x 4 bytes
    assert "number of blocks: 512" in out and "at 64 tokens: 32" in out
