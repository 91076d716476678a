"""Every malformed job file gives one clear line naming the key, exit code 2, and writes nothing."""
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from unstable_dask import cli as run

BAD = sorted((Path(__file__).parent / "bad_jobs").glob("*.toml"))


def _expected(path: Path) -> str:
    first = path.read_bytes().split(b"\n", 1)[0].decode()
    assert first.startswith("# expect: "), path
    return first.removeprefix("# expect: ")


def _command(path: Path) -> str:
    """The command a fixture is given to: `round`, or the one its second line names (`# command: league`),
    for a mistake only that command can meet (the lake is read when a league starts, not at load)."""
    lines = path.read_bytes().split(b"\n", 2)
    return lines[1].decode().removeprefix("# command: ") if len(lines) > 1 and lines[1].startswith(b"# command: ") \
        else "round"


def test_corpus_is_large():
    assert len(BAD) >= 45


@pytest.fixture(scope="module")
def imported():
    """The modules a `round` command imports, loaded once: each case then times its own checks."""
    import unstable_dask.learn.learner  # noqa: F401
    import unstable_dask.play.round  # noqa: F401
    import unstable_dask.rate.ratings  # noqa: F401


@pytest.mark.parametrize("path", BAD, ids=[p.stem for p in BAD])
def test_bad_job_file(path, tmp_path, capsys, imported):
    lake = tmp_path / "lake"
    t = time.perf_counter()
    code = run.main([_command(path), "--job", str(path), "--set", f'run.lake="{lake}"',
                     "--set", f'run.reports="{tmp_path / "reports"}"'])
    seconds = time.perf_counter() - t
    out = capsys.readouterr()
    message = " ".join(out.err.split())  # rich may wrap long lines
    assert code == 2
    assert _expected(path) in message
    assert str(path) in message or "cluster.address" in message  # names the file
    assert "Traceback" not in out.err + out.out
    assert not lake.exists(), "nothing may be written for a bad job"
    assert seconds < 5, f"{path.name} took {seconds:.1f} s to be refused"


@pytest.mark.parametrize("text, key", [('[round]\ntrain_games = "lots"\n', "round.train_games"),
                                       ('[learn]\nstep_transforms = ["SELECT nope FROM steps"]\n',
                                        "learn.step_transforms[0]")], ids=["type", "sql"])
def test_bad_job_in_a_subprocess_has_no_traceback(tmp_path, text, key):
    bad = tmp_path / "job.toml"
    bad.write_text(text)
    t = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "unstable_dask.run", "round", "--job", str(bad)],
                       capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert p.returncode == 2
    assert p.stderr.strip().count("\n") == 0, p.stderr
    assert key in p.stderr and "Traceback" not in p.stderr
    assert sorted(x.name for x in tmp_path.iterdir()) == ["job.toml"]  # no lake, no reports, no catalog
    assert time.perf_counter() - t < 15  # the whole command, Python start and imports included


def test_sql_that_writes_is_refused(tmp_path, capsys):
    code = run.main(["sql", f"COPY (SELECT 1) TO '{tmp_path}/x.csv'", "--lake", str(tmp_path)])
    assert code == 2 and "only SELECT" in capsys.readouterr().err
    assert not (tmp_path / "x.csv").exists()


def test_shipped_jobs_load_by_name_from_anywhere(tmp_path, monkeypatch):
    from unstable_dask.errors import JobError
    from unstable_dask.jobfile import load_job
    here = load_job(Path(__file__).parents[2] / "jobs" / "smollm2-cpu.toml")
    monkeypatch.chdir(tmp_path)  # outside the checkout, as after `pip install unstable-dask`
    for name in ("smollm2-cpu", "jobs/smollm2-cpu.toml"):
        assert load_job(name).model_dump() == here.model_dump()
    with pytest.raises(JobError, match=r"nope\.toml: job file not found \(shipped jobs: .*demo"):
        load_job("jobs/nope.toml")
    with pytest.raises(JobError, match="not found"):
        load_job("elsewhere/demo.toml")  # only bare names and jobs/<name> fall back to the shipped copy


@pytest.mark.slow
def test_pip_install_ships_the_job_files(tmp_path):
    import zipfile
    root = Path(__file__).parents[2]
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(root),
                    "-w", str(tmp_path)], check=True, capture_output=True)
    [wheel] = tmp_path.glob("unstable_dask-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for job in (root / "jobs").glob("*.toml"):
        assert f"unstable_dask/jobs/{job.name}" in names


def test_install_stops_at_once_naming_the_folder_when_the_disk_is_too_full(tmp_path):
    """Out of room, pip used to fail minutes into `make install` (CI, stop 63); the check comes first."""
    venv = tmp_path / "venv"
    out = subprocess.run(["bash", str(Path(__file__).parents[2] / "scripts" / "install.sh"), str(venv)],
                         env={**os.environ, "INSTALL_MIN_FREE_GB": "1000000000"}, capture_output=True, text=True)
    assert out.returncode == 1
    assert f"install: {venv} needs about 1000000000 GB free and its filesystem has " in out.stderr
    assert not venv.exists()


@pytest.mark.parametrize("key", ["run.lake", "run.reports"])
def test_an_empty_lake_or_reports_location_is_refused(tmp_path, capsys, monkeypatch, imported, key):
    """run.lake = "" used to write every table into the current folder."""
    monkeypatch.chdir(tmp_path)
    assert run.main(["round", "--set", f'{key}=""']) == 2
    assert f"key '{key}' has value '': an empty location would write into the current folder" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_an_offline_model_in_the_local_cache_is_accepted(tmp_path, monkeypatch):
    """The offline check refuses only what the Hugging Face cache does not hold."""
    from huggingface_hub import constants

    from unstable_dask.errors import JobError
    from unstable_dask.inference.weights import resolve_model
    snap = tmp_path / "models--some-org--some-model" / "snapshots" / "0123abcd"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")
    (tmp_path / "models--some-org--some-model" / "refs").mkdir()
    (tmp_path / "models--some-org--some-model" / "refs" / "main").write_text("0123abcd")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve_model("some-org/some-model") == "some-org/some-model"
    with pytest.raises(JobError, match="not in the local cache"):
        resolve_model("some-org/other-model")
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # online: the hub answers when the model loads
    assert resolve_model("some-org/other-model") == "some-org/other-model"
