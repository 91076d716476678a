"""The job-key reference (docs/job-keys.md): every key described in the code, the page generated from
it and current, and every key the shipped jobs use on it."""
import re
from pathlib import Path
from typing import Any

import tomllib

from unstable_dask import jobkeys as reference
from unstable_dask.config import (
    EndpointConfig,
    EnvSpec,
    LeagueGame,
    LoraConfig,
    OpponentConfig,
    Strict,
    VllmConfig,
)
from unstable_dask.jobfile import shipped_jobs
from unstable_dask.learn import algorithms

ROOT = Path(__file__).resolve().parents[2]


def test_every_field_of_every_job_config_class_has_a_description():
    classes = reference.config_classes()
    nested = [LoraConfig, VllmConfig, EnvSpec, OpponentConfig, EndpointConfig, LeagueGame]
    assert all(c in classes for c in nested), "the walk from Job missed a nested settings class"
    assert all(algorithms.config_class(n) in classes for n in algorithms.ALGORITHMS)
    missing = reference.undocumented(classes)
    assert not missing, ("job settings without a description (write a docstring on the line under the field): "
                         + ", ".join(missing))


def test_a_new_nested_class_with_a_bare_field_is_caught():
    """The walk follows list[...], dict[str, ...] and Optional[...] into classes nobody listed."""
    class Deep(Strict):
        bare: int = 0

    class Inner(Strict):
        deep: dict[str, Deep] = {}
        """Documented."""

    class Outer(Strict):
        inner: list[Inner] = []
        """Documented."""

    assert reference.models_under(Outer) == [Outer, Inner, Deep]
    assert [m.rsplit(".", 1)[1] for m in reference.undocumented(reference.models_under(Outer))] == ["bare"]


def test_the_reference_page_is_generated_from_the_config_classes():
    page = ROOT / reference.PAGE
    assert page.is_file(), f"{reference.PAGE} is missing: generate it with `{reference.COMMAND}` (from the repo root)"
    assert page.read_text(encoding="utf-8") == reference.markdown(), (
        f"{reference.PAGE} drifted from the config classes: regenerate it with `{reference.COMMAND}` "
        f"(from the repository root)")


def undocumented_keys(table: dict, path: str = "") -> list[str]:
    """Dotted keys of a parsed job file that the reference does not list. A documented key ends the
    walk (a pass-through table such as model.vllm.extra holds keys of its own); an array of tables
    is walked element by element; `<name>` in a documented key stands for any one name."""
    patterns = [re.compile(re.escape(k).replace(re.escape("<name>"), r"[^.]+") + "$") for k in reference.keys()]
    out = []

    def walk(value: Any, key: str) -> None:
        if key and any(p.match(key) for p in patterns):
            return
        if isinstance(value, dict):
            for k, v in value.items():
                walk(v, f"{key}.{k}" if key else k)
        elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            for v in value:
                walk(v, key)
        else:
            out.append(key)
    walk(table, path)
    return out


def test_every_key_of_every_shipped_job_is_in_the_reference():
    jobs = shipped_jobs()
    assert len(jobs) >= 10
    for path in jobs.values():
        missing = undocumented_keys(tomllib.loads(path.read_text(encoding="utf-8")))
        assert not missing, f"jobs/{path.name} uses keys the reference does not list: {missing}"


def test_the_key_check_finds_a_key_the_reference_lacks():
    raw = {"model": {"lora": {"rank": 8, "rnak": 8}, "vllm": {"extra": {"anything": 1}}},
           "endpoints": {"gemini": {"model": "m", "base_url": "https://x"}},
           "round": {"train_envs": [{"env_id": "a"}, {"env_id": "b", "wieght": 2}]}, "learn": {"kl_coef": 0.1}}
    assert undocumented_keys(raw) == ["model.lora.rnak", "round.train_envs.wieght"]


def test_each_table_lists_its_own_keys_with_type_default_and_bounds():
    page = reference.markdown()
    headers = [t.header for t in reference.tables()]
    for h in ("[run]", "[model]", "[model.lora]", "[model.vllm]", "[cluster]", "[round]", "[[round.train_envs]]",
              "[[round.eval_envs]]", "[round.opponents]", "[learn]", "[ratings]", "[endpoints.<name>]", "[league]",
              "[[league.games]]", *(f'[learn] algorithm = "{n}"' for n in algorithms.ALGORITHMS)):
        assert h in headers and f"\n## {h}\n" in page, h
    assert "| top_p | float | `1.0` | > 0.0; <= 1.0 |" in page
    assert '| backend | string | `"auto"` | `"auto"`, `"hf"`, `"vllm"` |' in page
    assert "| env_id | string | required |" in page and "| api_key_env | string | unset |" in page
    grpo = page.split('## [learn] algorithm = "grpo"', 1)[1].split("\n## ", 1)[0]
    assert "| clip_ratio |" in grpo and "| lr |" not in grpo  # its own keys, not the shared ones again

