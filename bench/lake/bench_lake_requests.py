"""Delta-log reads and object-store requests per `round` and per `learn`, this tree vs another
(by default the last commit before the Lake object), on an s3:// lake served by moto.

Both trees run the same commands in fresh processes against their own lake in one moto server:
round 0 (a fresh lake), learn (ckpt-1), round 1 (a checkpoint to play). Delta-log reads are the
driver's DeltaTable constructions; requests are every HTTP request the server recorded during the
command (driver, Dask workers, delta-rs, pyarrow and s3fs alike).

    python bench/lake/bench_lake_requests.py [--before 4651957]

Writes bench/results/lake_requests.json and prints a markdown table.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout: its package, bench/common.py, tests/helpers
sys.path[:0] = [str(ROOT), str(ROOT / "bench"), str(ROOT / "tests")]
MEASURES = ["unstable_dask/lake/", "unstable_dask/play/", "unstable_dask/learn/", "unstable_dask/loop.py", "unstable_dask/run.py", "unstable_dask/cli.py"]  # what bench/stale.py checks for changes since a result's commit

from common import row, save

RUNNER = """
import json, sys
import deltalake
reads = [0]
init = deltalake.DeltaTable.__init__
def counted(self, *a, **k):
    reads[0] += 1
    init(self, *a, **k)
deltalake.DeltaTable.__init__ = counted
from unstable_dask.run import main
code = main(sys.argv[2:])
json.dump({"delta_log_reads": reads[0], "rc": code}, open(sys.argv[1], "w"))
"""
SETS = ["round.train_games=8", "round.eval_games=4", "round.games_per_task=4", "cluster.n_workers=1",
        "model.max_new_tokens=8", "learn.batch_size=8", "learn.mini_batch_size=4", "cluster.dashboard=false"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def moto(port: int, recording: Path) -> subprocess.Popen:
    env = dict(os.environ, MOTO_RECORDER_FILEPATH=str(recording))
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return server
        except OSError:
            if time.time() > deadline:
                raise RuntimeError("moto server did not start") from None
            time.sleep(0.1)


def api(port: int, what: str) -> bytes:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/moto-api/recorder/{what}",
                                 method="GET" if what.startswith("download") else "POST")
    with urllib.request.urlopen(req) as r:
        return r.read()


def measure(tree: Path, lake: str, port: int, env: dict) -> dict:
    out = {}
    for name, cmd in (("round 0", ["round"]), ("learn", ["learn"]), ("round 1", ["round"])):
        api(port, "reset-recording")
        api(port, "start-recording")
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            args = [sys.executable, "-c", RUNNER, f.name, *cmd, "--job", str(ROOT / "jobs" / "demo.toml"),
                    "--set", f'run.lake="{lake}"', *[x for s in SETS for x in ("--set", s)]]
            t0 = time.perf_counter()
            proc = subprocess.run(args, cwd=tree, env=dict(env, PYTHONPATH=str(tree)), capture_output=True, text=True)
            wall = time.perf_counter() - t0
            if proc.returncode != 0:
                raise RuntimeError(f"{name} in {tree} failed:\n{proc.stderr[-3000:]}")
            result = json.load(open(f.name))
        api(port, "stop-recording")
        lines = [json.loads(x) for x in api(port, "download-recording").decode().splitlines() if x.strip()]
        by_method: dict[str, int] = {}
        for entry in lines:
            by_method[entry["method"]] = by_method.get(entry["method"], 0) + 1
        out[name] = dict(delta_log_reads=result["delta_log_reads"], requests=len(lines), by_method=by_method,
                         wall_s=round(wall, 2))
        print(row(tree.name, name, result["delta_log_reads"], len(lines), by_method), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", default="4651957", help="the commit to compare with (default: before the Lake object)")
    args = ap.parse_args()
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        before = Path(tmp) / "before"
        subprocess.run(["git", "worktree", "add", "-q", "--detach", str(before), args.before], cwd=ROOT, check=True)
        recording = Path(tmp) / "recording.jsonl"
        server = moto(port, recording)
        try:
            env = dict(os.environ, AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
                       AWS_REGION="us-east-1", AWS_DEFAULT_REGION="us-east-1",
                       AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}", AWS_ALLOW_HTTP="true", HF_HUB_OFFLINE="1")
            import boto3
            os.environ.update({k: v for k, v in env.items() if k.startswith("AWS_")})
            boto3.client("s3").create_bucket(Bucket="bench")
            results = {"before": measure(before, "s3://bench/before", port, env),
                       "after": measure(ROOT, "s3://bench/after", port, env)}
        finally:
            server.kill()
            subprocess.run(["git", "worktree", "remove", "--force", str(before)], cwd=ROOT, check=False)
    print("\n| command | Delta-log reads before | after | ratio | S3 requests before | after | ratio |")
    print("|---|---|---|---|---|---|---|")
    for name in results["after"]:
        b, a = results["before"][name], results["after"][name]
        print(row(name, b["delta_log_reads"], a["delta_log_reads"], f"{a['delta_log_reads'] / b['delta_log_reads']:.2f}",
                  b["requests"], a["requests"], f"{a['requests'] / b['requests']:.2f}"))
    print(save("lake_requests", {"before_commit": args.before, "job_settings": SETS, **results}, settings=vars(args)))


if __name__ == "__main__":
    main()
