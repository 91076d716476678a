"""Shared by the bench scripts: result files and the markdown row each prints."""
from __future__ import annotations

import json
import os
import platform
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def machine() -> str:
    return f"{platform.machine()}, {os.cpu_count()} cores, {platform.python_version()}"


def save(name: str, data: dict) -> Path:
    """Write bench/results/<name>.json (with the command line and machine) and return its path."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    data = {"bench": name, "machine": machine(), "date": time.strftime("%Y-%m-%d"),
            "command": " ".join(["python", *sys.argv]), **data}
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    return path


def row(*cells) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"
