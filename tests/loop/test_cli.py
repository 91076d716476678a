"""What a user sees when something is wrong: one line and exit code 2, never a traceback, never
an empty answer for a typo. Each fault is real: a lake path that is not there, an S3 endpoint
nobody listens on, a full or read-only filesystem, a damaged Delta log or adapter."""
import contextlib
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from unstable_dask.cli import main

from helpers import synthetic_lake as sl

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def lake(tmp_path) -> Path:
    sl.make_run(tmp_path / "lake", "syn", rounds=2, games_per_round=12, seed=1, hostile=False)
    return tmp_path / "lake"


def one_line(capsys, *needles: str) -> str:
    out = capsys.readouterr()
    err = out.err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error:"), err
    assert "Traceback" not in out.err + out.out
    for n in needles:
        assert n in err, err
    return err


def test_a_lake_that_is_not_there_is_an_error_for_every_reader(tmp_path, lake, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    typo = str(tmp_path / "lkae")
    for argv in (["sql", "SELECT count(*) FROM games", "--lake", typo], ["compact", "--lake", typo],
                 ["vacuum", "--lake", typo]):
        assert main(argv) == 2
        one_line(capsys, f"--lake {typo!r}: there is no lake at")
    for cmd in ("learn", "rate", "report", "track", "rollback"):
        extra = ["--to", "base"] if cmd == "rollback" else []
        trackers = ["--set", 'run.trackers=["mlflow"]'] if cmd == "track" else []
        assert main([cmd, "--set", f'run.lake="{typo}"', "--set", "run.name=syn", *extra, *trackers]) == 2
        one_line(capsys, "run.lake", "there is no lake at")
    assert not Path(typo).exists()  # nothing created
    assert main(["rate", "--set", f'run.lake="{lake}"', "--set", "run.name=sny"]) == 2
    one_line(capsys, "run 'sny' has no committed round", "runs there: 'syn'")
    assert not (lake / "ratings" / "run=sny").exists()


def test_bad_arguments_are_one_line(lake, capsys):
    L = str(lake)
    cases = [(["sql", "", "--lake", L], "no statement to run"),
             (["sql", "  ;  ", "--lake", L], "no statement to run"),
             (["sql", "SELECT game_id, seats FROM games", "--lake", L, "--format", "csv"], "column(s) seats hold lists"),
             (["vacuum", "--lake", L, "--retention-hours", "nan"], "--retention-hours: expected a finite number"),
             (["vacuum", "--lake", L, "--retention-hours", "inf"], "--retention-hours: expected a finite number"),
             (["compact", "--lake", L, "--target-mb", "0"], "--target-mb: expected a whole number of MB"),
             (["compact", "--lake", L, "--target-mb", str(2**60)], "--target-mb: expected a whole number of MB")]
    for argv, needle in cases:
        assert main(argv) == 2, argv
        one_line(capsys, needle)
    assert main(["sql", "SELECT game_id FROM games LIMIT 1", "--lake", L, "--format", "csv"]) == 0


def test_a_damaged_delta_log_is_one_line(lake, capsys):
    newest = sorted((lake / "games/_delta_log").glob("*.json"))[-1]
    newest.write_text('{"add": {"path": "run=syn/round=1/x.parquet", "size": ')  # torn JSON
    assert main(["sql", "SELECT count(*) FROM games", "--lake", str(lake)]) == 2
    one_line(capsys, "storage error")


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nobody listens once the socket is closed


def test_an_unreachable_object_store_is_one_line(tmp_path, capsys, monkeypatch):
    pytest.importorskip("s3fs")
    from unstable_dask.lake import storage
    for k, v in dict(AWS_ACCESS_KEY_ID="x", AWS_SECRET_ACCESS_KEY="x", AWS_REGION="us-east-1",
                     AWS_ENDPOINT_URL=f"http://127.0.0.1:{_closed_port()}", AWS_ALLOW_HTTP="true",
                     AWS_EC2_METADATA_DISABLED="true").items():
        monkeypatch.setenv(k, v)
    storage.forget_remote_filesystems()
    try:
        assert main(["sql", "SELECT count(*) FROM games", "--lake", "s3://lake/x"]) == 2
        one_line(capsys, "storage error", "onnect")  # connect / Connection refused
        assert main(["round", "--set", 'run.lake="s3://lake/x"', "--set", "cluster.dashboard=false"]) == 2
        one_line(capsys, "storage error")
    finally:
        storage.forget_remote_filesystems()


def _cli(args, **kw):
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{ROOT / 'tests'}", HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "unstable_dask.run", *args], capture_output=True, text=True,
                          env=env, timeout=300, **kw)


def _assert_one_line(p, *needles):
    assert p.returncode == 2, p.stderr[-3000:]
    err = p.stderr.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in p.stderr, err[-3000:]
    for n in needles:
        assert n in err, err


def test_a_file_size_limit_while_writing_is_one_line(lake):
    """RLIMIT_FSIZE (`ulimit -f`): every write past 1 KiB fails with EFBIG, as a full disk fails a write."""
    p = _cli(["rate", "--set", f'run.lake="{lake}"', "--set", "run.name=syn"],
             preexec_fn=lambda: __import__("resource").setrlimit(__import__("resource").RLIMIT_FSIZE, (1024, 1024)))
    _assert_one_line(p, "storage error", "File too large")
    assert not list(lake.glob("ratings*/**/*.parquet"))  # nothing half-written


@contextlib.contextmanager
def _mounted(path: Path, *options: str):
    """A filesystem mounted at `path` (root only: skips otherwise)."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or subprocess.run(["mount", *options, str(path)], capture_output=True).returncode != 0:
        pytest.skip("mounting a filesystem needs root")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def test_a_full_disk_is_one_line(tmp_path, lake):
    with _mounted(tmp_path / "small", "-t", "tmpfs", "-o", "size=4m", "tmpfs") as small:
        shutil.copytree(lake, small / "lake")
        with open(small / "filler", "wb") as f:  # fill it to the last block
            with contextlib.suppress(OSError):
                while True:
                    f.write(b"\0" * 65536)
                    f.flush()
        p = _cli(["rate", "--set", f'run.lake="{small / "lake"}"', "--set", "run.name=syn"])
        _assert_one_line(p, "storage error", "No space left on device")


def test_a_read_only_lake_is_one_line(tmp_path, lake):
    """The lake's filesystem is read-only (a read-only bind mount as root; without root, folders
    without write permission): reading works, writing ratings is one line."""
    if os.geteuid() == 0:
        ctx = _mounted(lake, "--bind", str(lake))
        with ctx:
            assert subprocess.run(["mount", "-o", "remount,ro,bind", str(lake)], capture_output=True).returncode == 0
            _read_only_checks(lake)
    else:
        for d, _, _ in os.walk(lake):
            os.chmod(d, 0o555)
        try:
            _read_only_checks(lake)
        finally:
            for d, _, _ in os.walk(lake):
                os.chmod(d, 0o755)


def _read_only_checks(lake: Path) -> None:
    p = _cli(["sql", "SELECT count(*) AS n FROM games", "--lake", str(lake), "--format", "json"])
    assert p.returncode == 0 and '"n": 24' in p.stdout, p.stderr[-2000:]
    p = _cli(["rate", "--set", f'run.lake="{lake}"', "--set", "run.name=syn"])
    _assert_one_line(p, "storage error")
    assert "Read-only file system" in p.stderr or "Permission denied" in p.stderr


def test_a_damaged_adapter_is_one_line(tmp_path_factory, cache):
    """A checkpoint's adapter folder with a torn weights file or a garbled config: loading it is one
    line naming the folder, in the engine that would serve it (and in the learner: the same check)."""
    from unstable_dask.config import ModelConfig
    from unstable_dask.errors import JobError
    from unstable_dask.inference.engine import get_engine
    from unstable_dask.inference.weights import resolve_model

    from helpers import adapters
    [adapter] = adapters.random_adapters(resolve_model("builtin:tiny"), tmp_path_factory, n=1)
    engine = get_engine(ModelConfig(max_new_tokens=4))  # the engine `auto` picks here: vLLM where it runs
    try:
        assert len(engine.generate(["hello"], adapter=adapter)) == 1  # whole: it loads
        weights = Path(adapter.path) / "adapter_model.safetensors"
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
        torn = type(adapter)("ckpt-7", adapter.path)  # a name the engine has not loaded yet
        with pytest.raises(JobError, match=f"adapter 'ckpt-7' at {adapter.path} is damaged or incomplete"):
            engine.generate(["hello"], adapter=torn)
        (Path(adapter.path) / "adapter_config.json").write_text("{ not json")
        with pytest.raises(JobError, match="is damaged or incomplete"):
            engine.generate(["hello"], adapter=type(adapter)("ckpt-8", adapter.path))
    finally:
        engine.close()  # a resident vLLM engine holds its KV cache: free it for the tests after


def test_a_table_written_to_a_pipe_keeps_its_headers_whole(lake):
    """`make demo`'s summary in a log or a pipe: rich folded tables at 80 columns there, splitting
    their own headers (`model_u` / `id`); now a table keeps its natural width and a line its length."""
    cols = ", ".join(f"count(*) AS games_counted_{i}" for i in range(6))
    p = _cli(["sql", f"SELECT split, {cols} FROM games GROUP BY split ORDER BY split", "--lake", str(lake)])
    assert p.returncode == 0, p.stderr[-3000:]
    header = next(line for line in p.stdout.splitlines() if "split" in line)
    assert all(f"games_counted_{i}" in header for i in range(6)), p.stdout
    assert len(header) > 80
    p = _cli(["compact", "--lake", str(lake), "--run", "syn"])  # a line naming the lake's path, past 80 columns
    assert p.returncode == 0, p.stderr[-3000:]
    line = next(line for line in p.stdout.splitlines() if line.startswith("lake: "))
    assert len(line) > 80 and line.endswith("`run vacuum`)"), p.stdout
