"""Every benchmark writes its JSON through benchmarks.result_file; none writes one by hand."""

from __future__ import annotations

import ast
import json
from pathlib import Path

from benchmarks.result_file import write_result

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
# Files that are inputs, not results: a peer engine's job and answer, a LoRA adapter's config.
NOT_RESULTS = {"beam_search.py", "beam_search_peer.py", "lora.py", "vs_vllm.py"}


def test_write_result_makes_the_folder_and_round_trips(tmp_path):
    path = write_result(tmp_path / "deep" / "r.json", {"tok_s": 173.9, "rows": [1, 2]})
    assert json.loads(path.read_text()) == {"tok_s": 173.9, "rows": [1, 2]}
    assert path.read_text().endswith("}\n")


def _writes_json_by_hand(path: Path) -> bool:
    """A `.write_text(json.dumps(...))` or `json.dump(...)` call anywhere in the file."""
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        if node.func.attr == "dump" and getattr(node.func.value, "id", None) == "json":
            return True
        if node.func.attr == "write_text" and any(
                isinstance(a, ast.Call) and getattr(a.func, "attr", None) == "dumps" for a in node.args):
            return True
    return False


def test_no_benchmark_writes_its_result_by_hand():
    by_hand = sorted(p.name for p in BENCHMARKS.glob("*.py")
                     if p.name not in NOT_RESULTS and p.name != "result_file.py" and _writes_json_by_hand(p))
    assert by_hand == []
