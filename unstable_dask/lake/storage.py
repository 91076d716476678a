"""Where the lake's files live: a local folder, or an object store (`s3://bucket/prefix`).

Every file operation on the lake goes through here, on pyarrow's filesystems. A location is a
string: a local path, or a URI. Object stores take credentials and endpoint from the usual
environment variables (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_REGION, AWS_ENDPOINT_URL;
AWS_ALLOW_HTTP=true for a plain-http endpoint), read the same way by pyarrow, delta-rs and s3fs.

What differs on an object store: there is no rename, but a PUT is atomic (an object appears
whole or not at all), so a file is written under its final name directly; adapters (directories
that peft and vLLM load from local disk) are uploaded after they are saved and downloaded once
per machine into a cache; DuckDB reads through s3fs (the `s3` extra), registered per connection.
"""
from __future__ import annotations

import functools
import hashlib
import os
import shutil
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

Location = Union[str, Path]


def cache_root() -> Path:
    """This machine's cache (built models, downloaded adapters): $UNSTABLE_DASK_CACHE or ~/.cache/unstable_dask."""
    return Path(os.environ.get("UNSTABLE_DASK_CACHE") or Path.home() / ".cache" / "unstable_dask")


def is_remote(loc: Location) -> bool:
    return "://" in str(loc)


def root(lake: Location) -> str:
    """The lake's canonical location: an absolute local path, or its URI without a trailing slash."""
    return str(lake).rstrip("/") if is_remote(lake) else str(Path(lake).resolve())


def join(loc: Location, *parts: str) -> str:
    return "/".join([str(loc).rstrip("/"), *parts]) if is_remote(loc) else str(Path(loc).joinpath(*parts))


def name(loc: Location) -> str:
    return str(loc).rstrip("/").rsplit("/", 1)[-1]


@functools.lru_cache(maxsize=None)
def _remote_fs(scheme_and_bucket: str) -> pafs.FileSystem:
    return pafs.FileSystem.from_uri(scheme_and_bucket)[0]


def resolve(loc: Location) -> tuple[pafs.FileSystem, str]:
    """(filesystem, path on it) of a location; one filesystem object per bucket, reused."""
    s = str(loc)
    if not is_remote(s):
        return pafs.LocalFileSystem(), str(Path(s).absolute())
    scheme, rest = s.split("://", 1)
    return _remote_fs(f"{scheme}://{rest.split('/', 1)[0]}"), rest.rstrip("/")


def forget_remote_filesystems() -> None:
    """Drop the cached object-store filesystems: the next access builds them again from the
    environment (credentials or endpoint changed, e.g. another S3 server)."""
    _remote_fs.cache_clear()


def size(loc: Location) -> Optional[int]:
    """The file's size in bytes, None when there is no file there."""
    fs, path = resolve(loc)
    info = fs.get_file_info(path)
    return info.size if info.type == pafs.FileType.File else None


def stat(loc: Location) -> tuple[int, int]:
    """(size in bytes, modification time in ms) of a file, in one request."""
    fs, path = resolve(loc)
    info = fs.get_file_info(path)
    return info.size, int(info.mtime.timestamp() * 1000)


def is_dir(loc: Location) -> bool:
    fs, path = resolve(loc)
    return fs.get_file_info(path).type == pafs.FileType.Directory


def list_dir(loc: Location, recursive: bool = False) -> list[str]:
    """Locations of the entries under `loc` (files and folders; every file below it when
    `recursive`), sorted; [] when there is nothing there."""
    fs, path = resolve(loc)
    infos = fs.get_file_info(pafs.FileSelector(path, allow_not_found=True, recursive=recursive))
    if recursive:
        infos = [i for i in infos if i.type == pafs.FileType.File]
    return sorted(join(loc, i.path[len(path):].lstrip("/")) for i in infos)


@dataclass(frozen=True, order=True)
class Listed:
    """A file as a folder listing shows it (on an object store the listing carries size and mtime)."""
    path: str
    size: int
    mtime_ms: int


def list_files(loc: Location, recursive: bool = False) -> list[Listed]:
    """The files directly under `loc` (every file below it when `recursive`) with their sizes and
    mtimes, from one listing, sorted."""
    fs, path = resolve(loc)
    infos = fs.get_file_info(pafs.FileSelector(path, allow_not_found=True, recursive=recursive))
    return sorted(Listed(join(loc, i.path[len(path):].lstrip("/")), i.size, int(i.mtime.timestamp() * 1000))
                  for i in infos if i.type == pafs.FileType.File)


def delete(loc: Location) -> None:
    """Delete a file or a folder (with what it holds); nothing there is fine."""
    fs, path = resolve(loc)
    kind = fs.get_file_info(path).type
    if kind == pafs.FileType.Directory:
        fs.delete_dir(path)
    elif kind == pafs.FileType.File:
        fs.delete_file(path)


def read_ends(loc: Location, n: int) -> tuple[int, bytes, bytes]:
    """A file's size and its first and last `n` bytes (for magic-number checks), one open."""
    fs, path = resolve(loc)
    with fs.open_input_file(path) as f:
        size = f.size()
        head = f.read(n)
        f.seek(max(0, size - n))
        return size, head, f.read(n)


def is_whole_parquet(path: Location) -> bool:
    """Cheap check for a complete Parquet file: magic bytes at both ends."""
    try:
        size, head, tail = read_ends(path, 4)
        return size >= 12 and head == b"PAR1" and tail == b"PAR1"
    except OSError:
        return False


def read_metadata(loc: Location) -> pq.FileMetaData:
    """A Parquet file's footer (one open: on an object store a HEAD and a ranged GET); raises on a
    torn file."""
    fs, path = resolve(loc)
    with fs.open_input_file(path) as f:
        return pq.read_metadata(f)


def read_schema(loc: Location) -> pa.Schema:
    return read_metadata(loc).schema.to_arrow_schema()


def read_table(loc: Location, columns: Optional[list[str]] = None) -> pa.Table:
    fs, path = resolve(loc)
    return pq.read_table(path, filesystem=fs, columns=columns)


def write_parquet(loc: Location, data: pa.Table) -> None:
    """Write a Parquet file so that no reader ever sees part of it: locally under a temp name,
    footer-checked, then renamed; on an object store with one PUT (atomic there)."""
    if is_remote(loc):
        fs, path = resolve(loc)
        pq.write_table(data, path, filesystem=fs, compression="zstd")
        return
    final = Path(loc)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".{final.stem}.{uuid.uuid4().hex[:8]}.tmp"
    try:
        pq.write_table(data, tmp, compression="zstd")
        pq.read_metadata(tmp)  # a torn write fails here, never behind the final name
        os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)


def put_dir(local_dir: Location, loc: Location) -> None:
    """Copy a local folder to `loc` (a new, attempt-named location: nothing there to replace)."""
    if not is_remote(loc):
        Path(loc).parent.mkdir(parents=True, exist_ok=True)
        os.replace(local_dir, loc)
        return
    fs, path = resolve(loc)
    pafs.copy_files(str(local_dir), path, source_filesystem=pafs.LocalFileSystem(), destination_filesystem=fs)


def local_dir(loc: Location) -> str:
    """A local folder with the contents of `loc`: itself when local; else a copy downloaded once
    into the cache (adapters are written once under unique names, so a cached copy never goes
    stale)."""
    if not is_remote(loc):
        return str(loc)
    dest = cache_root() / "remote" / hashlib.sha256(str(loc).encode()).hexdigest()[:24] / name(loc)
    if dest.is_dir():
        return str(dest)
    fs, path = resolve(loc)
    if fs.get_file_info(path).type != pafs.FileType.Directory:
        raise FileNotFoundError(f"no folder at {loc}")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=".download-"))
    try:
        for info in fs.get_file_info(pafs.FileSelector(path, recursive=True)):
            if info.type != pafs.FileType.File:
                continue
            out = tmp / "d" / info.path[len(path):].lstrip("/")
            out.parent.mkdir(parents=True, exist_ok=True)
            with fs.open_input_stream(info.path) as src, open(out, "wb") as dst:
                shutil.copyfileobj(src, dst)
        try:
            os.rename(tmp / "d", dest)
        except OSError:  # another process on this machine downloaded it first
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(dest)


def register_duckdb(con, lake: Location) -> None:
    """Let a DuckDB connection read the lake's files: s3fs (fsspec) for an object store."""
    if not is_remote(lake):
        return
    scheme = str(lake).split("://", 1)[0]
    try:
        import fsspec
        fs = fsspec.filesystem(scheme)
    except (ImportError, ValueError) as e:
        from unstable_dask.errors import JobError
        raise JobError(f"lake {lake}: reading a {scheme}:// lake with DuckDB needs its fsspec filesystem "
                       f"(pip install 'unstable-dask[s3]'): {e}") from None
    con.register_filesystem(fs)
