"""Every bench says what it measures and records what it was measured with, so bench/stale.py can
tell a stale figure from a current one. Static checks (syntax trees), no bench is run."""
from __future__ import annotations

import ast
import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = sorted(p for p in (ROOT / "bench").glob("*/*.py") if p.name.startswith("bench_") or p.name == "gpu_check.py")


def _stale():
    spec = importlib.util.spec_from_file_location("bench_stale", ROOT / "bench" / "stale.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_benches_live_in_stage_folders():
    assert len(SCRIPTS) >= 30
    assert not list((ROOT / "bench").glob("bench_*.py")), "a bench script outside bench/<stage>/"


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_bench_declares_measures_and_saves_through_common(script: Path):
    tree = ast.parse(script.read_text())
    measures = _stale().measures(script.read_text())
    assert measures, f"{script.name}: no module-level MEASURES list"
    for path in measures:
        assert (ROOT / path).exists(), f"{script.name}: MEASURES names {path}, which does not exist"
    imported = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module == "common"
                for a in n.names}
    assert "save" in imported, f"{script.name}: does not import save from bench/common.py"
    saves = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "save"]
    assert saves, f"{script.name}: writes no result through common.save"
    assert all(any(k.arg == "settings" for k in c.keywords) for c in saves), f"{script.name}: a save without settings="
    writes = [n for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr in ("write_text", "dump")
              and "results" in ast.unparse(n.value).lower() and ".json" in ast.unparse(n.value)]  # plots may sit beside
    assert not writes, f"{script.name}: writes a result file by itself, not through common.save"


def test_stale_ignores_bookkeeping_but_not_a_changed_measurement():
    stale = _stale()
    before = '"""Doc."""\nimport sys\nfrom common import save\n\ndef main(args):\n    save("x", {"n": 2 * 3})\n'
    moved = ('"""Doc, moved."""\nimport sys\nfrom pathlib import Path\nROOT = Path(__file__).resolve().parents[2]\n'
             'sys.path[:0] = [str(ROOT)]\nMEASURES = ["unstable_dask/lake/"]\nfrom common import save\n\n'
             'def main(args):\n    save("x", {"n": 2 * 3}, settings=vars(args))\n')
    changed = moved.replace("2 * 3", "2 * 4")
    assert stale.code_of(before) == stale.code_of(moved)
    assert stale.code_of(before) != stale.code_of(changed)


def test_every_result_records_its_commit_and_script():
    for result in sorted((ROOT / "bench" / "results").glob("*.json")):
        row = _stale().check(result)
        assert row["commit"], f"{result.name}: no commit"
        assert (ROOT / row["script"]).exists(), f"{result.name}: its script {row['script']} does not exist"


def test_save_records_commit_machine_and_settings(tmp_path, monkeypatch):
    _stale()  # puts bench/ on sys.path, as the bench scripts do
    import common
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    row = json.loads(common.save("probe", {"ratio": 0.5}, settings={"rounds": [100], "out": tmp_path}).read_text())
    assert row["ratio"] == 0.5 and row["settings"] == {"rounds": [100], "out": str(tmp_path)}
    assert len(row["commit"]) == 40 and isinstance(row["dirty"], bool)
    assert row["machine"]["cores"] and row["date"] and row["script"]
