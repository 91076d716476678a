"""Every malformed job file gives one clear line naming the key, exit code 2, and writes nothing."""
import subprocess
import sys
from pathlib import Path

import pytest

from unstable_dask import run

BAD = sorted((Path(__file__).parent / "bad_jobs").glob("*.toml"))


def _expected(path: Path) -> str:
    first = path.read_bytes().split(b"\n", 1)[0].decode()
    assert first.startswith("# expect: "), path
    return first.removeprefix("# expect: ")


def test_corpus_is_large():
    assert len(BAD) >= 20


@pytest.mark.parametrize("path", BAD, ids=[p.stem for p in BAD])
def test_bad_job_file(path, tmp_path, capsys):
    lake = tmp_path / "lake"
    code = run.main(["round", "--job", str(path), "--set", f'run.lake="{lake}"',
                     "--set", f'run.reports="{tmp_path / "reports"}"'])
    out = capsys.readouterr()
    message = " ".join(out.err.split())  # rich may wrap long lines
    assert code == 2
    assert _expected(path) in message
    assert str(path) in message or "cluster.address" in message  # names the file
    assert "Traceback" not in out.err + out.out
    assert not lake.exists(), "nothing may be written for a bad job"


def test_bad_job_in_a_subprocess_has_no_traceback(tmp_path):
    bad = tmp_path / "job.toml"
    bad.write_text('[round]\ntrain_games = "lots"\n')
    p = subprocess.run([sys.executable, "-m", "unstable_dask.run", "round", "--job", str(bad)],
                       capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert p.returncode == 2
    assert p.stderr.strip().count("\n") == 0, p.stderr
    assert "round.train_games" in p.stderr and "Traceback" not in p.stderr
    assert not (tmp_path / "lake").exists()


def test_sql_that_writes_is_refused(tmp_path, capsys):
    code = run.main(["sql", f"COPY (SELECT 1) TO '{tmp_path}/x.csv'", "--lake", str(tmp_path)])
    assert code == 2 and "only SELECT" in capsys.readouterr().err
    assert not (tmp_path / "x.csv").exists()
