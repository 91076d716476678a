"""Which bench results are older than the code they measured.

A result (bench/results/<name>.json, written by common.save) records the commit it was measured on
and its bench script; each script declares the package paths it measures in a module-level
`MEASURES` list. A result is stale when, between its measurement and the working tree,
  - a file under one of its script's MEASURES paths changed: its contents against the digest the
    result recorded (so a figure measured on a dirty tree stays current once that tree is
    committed), or, for results without one, `git diff --name-only <commit> -- <paths>`; or
  - the script itself changed beyond bookkeeping: its code is compared with the version at the
    result's commit as a syntax tree without docstrings, imports, `sys.path` edits, ROOT / MEASURES
    and the `settings=` of its save call, so that moving a script into bench/<stage>/ or recording
    more metadata does not mark its figures stale, while a change to what it runs does.

    python bench/stale.py            # one line per result: current, or stale since <commit>
    python bench/stale.py --json     # the same as JSON
    python bench/stale.py --check    # exit 1 when any result is stale
"""
from __future__ import annotations

import argparse
import ast
import hashlib
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from common import code_digest  # noqa: E402

RESULTS = ROOT / "bench" / "results"
_BOOKKEEPING = {"ROOT", "MEASURES"}


def git(*args: str) -> str | None:
    out = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True)
    return out.stdout if out.returncode == 0 else None


def measures(script_text: str) -> list[str] | None:
    """The script's module-level MEASURES list (read from its syntax tree, not by running it)."""
    for node in ast.parse(script_text).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "MEASURES" for t in node.targets):
            return [str(x) for x in ast.literal_eval(node.value)]
    return None


class _Strip(ast.NodeTransformer):
    """Drops what a script's figures do not depend on (see the module docstring)."""

    def visit_Import(self, node):
        return None

    visit_ImportFrom = visit_Import

    def visit_Assign(self, node):
        names = {t.id for t in node.targets if isinstance(t, ast.Name)}
        if names & _BOOKKEEPING or any("sys.path" in ast.unparse(t) for t in node.targets):
            return None
        return self.generic_visit(node)

    def visit_Expr(self, node):
        if isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            return None  # a docstring
        if "sys.path" in ast.unparse(node.value):
            return None
        return self.generic_visit(node)

    def visit_Call(self, node):
        if isinstance(node.func, ast.Name) and node.func.id == "save":
            node.keywords = [k for k in node.keywords if k.arg != "settings"]
        return self.generic_visit(node)


def code_of(script_text: str) -> str:
    tree = _Strip().visit(ast.parse(script_text))
    return ast.dump(ast.fix_missing_locations(tree), include_attributes=False)


def script_at(commit: str, script: str) -> str | None:
    """The script's text at `commit`: at its path, else in the flat bench/ of before the stage folders."""
    for path in (script, f"bench/{Path(script).name}"):
        text = git("show", f"{commit}:{path}")
        if text is not None:
            return text
    return None


def since(commit: str, paths: list[str]) -> str:
    """The first commit after `commit` that touched `paths`, or 'uncommitted changes'."""
    log = (git("log", "--reverse", "--format=%h", f"{commit}..HEAD", "--", *paths) or "").split()
    return log[0] if log else "uncommitted changes"


def check(result: Path) -> dict:
    d = json.loads(result.read_text())
    out = {"result": result.name, "commit": d.get("commit"), "date": d.get("date"), "script": d.get("script"),
           "stale": True, "why": [], "since": None}
    commit, script = out["commit"], out["script"]
    if not commit or not script or git("cat-file", "-e", f"{commit}^{{commit}}") is None:
        out["why"].append("no known commit" if not commit else "no script recorded" if not script
                          else f"commit {commit[:9]} not in this history")
        return out
    path = ROOT / script
    if not path.exists():
        out["why"].append(f"{script} no longer exists")
        return out
    now = path.read_text()
    paths = measures(now)
    if paths is None:
        out["why"].append(f"{script} declares no MEASURES")
        return out
    if d.get("code_digest"):  # measured on a tree that may have been dirty: compare contents, not commits
        if d.get("measures") != paths or code_digest(paths) != d["code_digest"]:
            out["why"].append("measured code changed since it was measured")
            out["since"] = since(commit, paths)
    else:
        changed = (git("diff", "--name-only", commit, "--", *paths) or "").split()
        if changed:
            out["why"].append(f"measured code changed: {', '.join(changed[:4])}" + (" ..." if len(changed) > 4 else ""))
            out["since"] = since(commit, paths)
    if d.get("script_digest"):
        script_changed = hashlib.sha256(code_of(now).encode()).hexdigest() != d["script_digest"]
    else:
        before = script_at(commit, script)
        script_changed = before is None or code_of(before) != code_of(now)
    if script_changed:
        out["why"].append(f"{script} changed")
        out["since"] = out["since"] or since(commit, [script])
    out["stale"] = bool(out["why"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print the list as JSON")
    ap.add_argument("--check", action="store_true", help="exit 1 when any result is stale")
    args = ap.parse_args()
    rows = [check(p) for p in sorted(RESULTS.glob("*.json"))]
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        for r in rows:
            state = f"stale since {r['since']}" if r["stale"] and r["since"] else "stale" if r["stale"] else "current"
            print(f"{r['result']:36} {(r['commit'] or '-')[:9]:9} {str(r['date'])[:10]:10} {state}"
                  + (f"  ({'; '.join(r['why'])})" if r["why"] else ""))
    sys.exit(1 if args.check and any(r["stale"] for r in rows) else 0)


if __name__ == "__main__":
    main()
