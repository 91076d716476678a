"""What every report page shares: the jinja2 environment (autoescape, the page's one script and its
hash for the Content-Security-Policy), SQL rows as dicts, game transcripts and atomic writes."""
from __future__ import annotations

import base64
import functools
import hashlib
import os
import uuid
from pathlib import Path
from typing import Any

import jinja2
from markupsafe import Markup

from unstable_dask.report import charts

HERE = Path(__file__).resolve().parent
MAX_TURN_CHARS = 4000  # long prompts/observations are cut (the lake keeps them whole)


def rows(con, sql: str, params: Any) -> list[dict]:
    """A query's rows as dicts (params are values: model text never enters the SQL)."""
    return con.sql(sql, params=params).to_arrow_table().to_pylist()


def turns(con, run_name: str, game_ids: list[str]) -> dict[str, list[dict]]:
    """The turns of these games of a run, by game and in order, long texts cut to MAX_TURN_CHARS."""
    out: dict[str, list[dict]] = {g: [] for g in game_ids}
    for t in rows(con, """SELECT game_id, turn, pid, model_uid, observation, prompt, completion, action, format_ok,
                                 invalid_move FROM turns WHERE run = ? AND list_contains(?, game_id) ORDER BY game_id, turn""",
                  [run_name, game_ids]):
        for k in ("observation", "prompt", "completion"):
            if t[k] is not None and len(t[k]) > MAX_TURN_CHARS:
                t[k] = t[k][:MAX_TURN_CHARS] + f"\n... [{len(t[k]) - MAX_TURN_CHARS} more characters]"
        out[t["game_id"]].append(t)
    return out


@functools.cache
def env() -> jinja2.Environment:
    """The templates' environment: autoescape on, undefined names an error."""
    e = jinja2.Environment(loader=jinja2.FileSystemLoader(HERE / "templates"), autoescape=True,
                           undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    e.filters["num"] = lambda v, fmt="{:.2f}": "" if v is None else fmt.format(v)
    e.policies["json.dumps_kwargs"] = {"sort_keys": True, "separators": (",", ":"), "allow_nan": False}
    # Our own static files (not data) are inlined so the page works from file:// with no requests:
    # the Vega bundle and our script are the page's one <script>.
    e.globals["static"] = {p.name: Markup(p.read_text(encoding="utf-8")) for p in sorted((HERE / "static").iterdir())
                           if p.is_file()}
    script = charts.bundle() + "\n" + (HERE / "static" / "report.js").read_text(encoding="utf-8")
    if "</script" in script.lower() or "<!--" in script:  # either would change how the HTML parser ends the element
        raise RuntimeError("the report's script holds '</script' or '<!--'")
    e.globals["page_script"] = Markup(script)
    # The Content-Security-Policy allows exactly that script (by hash): even if escaping ever failed,
    # an injected <script> or on* attribute would not run.
    digest = hashlib.sha256(script.encode("utf-8")).digest()
    e.globals["script_hash"] = "sha256-" + base64.b64encode(digest).decode("ascii")
    return e


def write(path: Path, text: str) -> None:
    """Write a page atomically: a reader sees the old page or the new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
