"""Reading a job file: TOML into the models of config/, then the checks that span several keys
(opponent names, what the algorithm needs, the learner's SQL run on empty tables), so a job
either loads whole or fails at once with one line naming the file, the key and the value.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Union, cast

import tomllib
from pydantic import ValidationError

from unstable_dask.config import Job, covers, entrant_spec, expert_parts, reserved_uid
from unstable_dask.errors import JobError
from unstable_dask.learn import algorithms, distributed
from unstable_dask.play.experts import SOLVES, solves
from unstable_dask.play.league import league_games
from unstable_dask.play.prompts import TEMPLATE_NAMES


def _loc(loc: tuple) -> str:
    # Drop pydantic's validator and union-member tags ("function-after[...]", "literal['a','b']", "int").
    def tag(p: Any) -> bool:
        return isinstance(p, str) and (p in ("int", "float", "str", "bool") or "[" in p)
    return ".".join(str(p) for p in loc if not tag(p)) or "<root>"


def _format_error(source: str, err: ValidationError, prefix: tuple = (), algorithm: Optional[str] = None) -> str:
    e = err.errors()[0]
    key = _loc(prefix + tuple(e["loc"]))
    msg = e["msg"].removeprefix("Value error, ")
    if e["type"] == "extra_forbidden":
        if algorithm is not None and len(e["loc"]) == 1:  # a [learn] key of another algorithm?
            owners = algorithms.owners(str(e["loc"][0]))
            if owners:
                return (f"{source}: key '{key}' is a setting of {' and '.join(owners)}, and learn.algorithm "
                        f"{algorithm!r} has no such setting (remove it, or choose one of those algorithms)")
        return f"{source}: unknown key '{key}' (check the spelling; docs/job-keys.md lists every key)"
    if e["type"] == "missing":
        return f"{source}: missing required key '{key}'"
    value = e.get("input")
    if isinstance(value, (dict, list)):
        return f"{source}: key '{key}': {msg}"
    return f"{source}: key '{key}' has value {value!r}: {msg}"


def _learn_settings(raw: dict, source: str) -> Any:
    """`[learn]` validated by the settings class of the algorithm it names."""
    table = raw.get("learn", {})
    if not isinstance(table, dict):
        raise JobError(f"{source}: key 'learn' must be a table ([learn]), got {table!r}")
    name = table.get("algorithm", "reinforce")
    if not isinstance(name, str) or name not in algorithms.ALGORITHMS:
        raise JobError(f"{source}: key 'learn.algorithm' has value {name!r}: unknown algorithm {name!r}; "
                       f"expected one of "
                       f"{', '.join(algorithms.ALGORITHMS)}")
    try:
        return algorithms.config_class(name).model_validate(table)
    except ValidationError as err:
        raise JobError(_format_error(source, err, ("learn",), name)) from None


def validate_job(raw: dict, source: str = "<default>") -> Job:
    """A Job from parsed TOML, every setting checked (the learner's SQL included); JobError if not."""
    learn = _learn_settings(raw, source)
    try:
        job = Job.model_validate({**raw, "learn": learn})
    except ValidationError as err:
        raise JobError(_format_error(source, err)) from None
    job.source = source
    if getattr(learn, "max_generation_len", 0) is None:  # the algorithms' divisor defaults to the generation cap
        learn.max_generation_len = job.model.max_new_tokens
    _check_templates(job)
    _check_opponents(job)
    _check_league(job)
    _check_algorithm(job)
    distributed.check_job(job)  # learn.devices within the cluster's workers, where the job says how many
    check_learn_sql(job)
    return job


def _check_templates(job: Job) -> None:
    """Every prompt template a job names is one of play/prompts.py."""
    keys = [("model.template", job.model.template)]
    for split in ("train", "eval"):
        keys += [(f"round.{split}_envs[{i}].template", e.template)
                 for i, e in enumerate(getattr(job.round, f"{split}_envs")) if e.template is not None]
    keys += [(f"league.games[{i}].template", g.template) for i, g in enumerate(job.league.games) if g.template is not None]
    for key, name in keys:
        if name not in TEMPLATE_NAMES:
            raise JobError(f"{job.source}: key '{key}' has value {name!r}: unknown template {name!r}; "
                           f"expected one of {', '.join(TEMPLATE_NAMES)}")


def _check_opponents(job: Job) -> None:
    """Every opponent name is something a round can seat. Checkpoint uids are checked by their
    form here (the lake is not read at load) and against the run's checkpoints when a round starts."""
    for key, name in job.named_opponents():
        if not (reserved_uid(name) or name in job.endpoints or (Path(name) / "adapter_config.json").is_file()):
            raise JobError(job.opponent_error(key, name))
    for key, name in job.named_opponents():
        _check_expert(job, key, name, _envs_seating(job, key))
    for i, name in enumerate(job.round.eval_baseline):  # it replays every eval game in the learner's seats
        _check_expert(job, f"round.eval_baseline[{i}]", name, [e.env_id for e in job.round.eval_envs])


def _envs_seating(job: Job, key: str) -> list[str]:
    """The env ids an opponent named at `key` (of Job.named_opponents) may be seated in."""
    r = job.round
    if key.startswith("round.opponents.fixed"):  # eval envs without their own list; train ones too when drawn from
        drawn = r.opponents.strategy in ("fixed", "match-quality")
        return [e.env_id for e in r.eval_envs if not e.opponents] + \
            [e.env_id for e in r.train_envs if drawn and not e.opponents]
    split, i = key.split("_envs[")[0].removeprefix("round."), int(key.split("_envs[")[1].split("]")[0])
    return [getattr(r, f"{split}_envs")[i].env_id]


def _check_expert(job: Job, key: str, name: str, env_ids: list[str]) -> None:
    """An expert agent's eps is in [0, 1], and it has a solver for every game it would play."""
    try:
        parts = expert_parts(name)
    except ValueError as err:
        raise JobError(f"{job.source}: key '{key}' has value {err}") from None
    if parts is None:
        return
    wrong = [e for e in env_ids if not solves(parts[0], e)]
    if wrong:
        raise JobError(f"{job.source}: key '{key}' names {name!r}: {parts[0]} has a solver for "
                       f"{' and '.join(SOLVES[parts[0]])} only, and would play {wrong[0]}")


def _check_league(job: Job) -> None:
    """[league] across keys: its own run, names that are endpoints or adapters, an anchor and first-pass
    entrants among the entrants (decided from the specs: the lake is not read at load)."""
    cfg, src = job.league, job.source
    if job.league_name == job.run.name:
        raise JobError(f"{src}: key 'league.name' has value {cfg.name!r}: a league writes its games under a run of "
                       f"its own; choose a name other than run.name")
    specs = [entrant_spec(e) for e in cfg.entrants]
    for i, (text, spec) in enumerate(zip(cfg.entrants, specs)):
        if spec.kind == "name" and text not in job.endpoints and not (Path(text) / "adapter_config.json").is_file():
            declared = ", ".join(repr(n) for n in job.endpoints) or "none declared"
            raise JobError(f"{src}: key 'league.entrants[{i}]' names entrant {text!r}: expected 'random', 'base', "
                           f"'base:<model>', '<run>:ckpt-<k>', '<run>:*', '<run>:every-<k>', an endpoint of "
                           f"[endpoints] ({declared}), or a LoRA adapter directory")
    experts = [(i, text) for i, (text, spec) in enumerate(zip(cfg.entrants, specs)) if spec.kind == "expert"]
    for i, text in experts:
        _check_expert(job, f"league.entrants[{i}]", text, [g.env_id for g in league_games(job)])
    named = [("league.anchor", cfg.anchor)] + [(f"league.first_pass[{i}]", f) for i, f in enumerate(cfg.first_pass)]
    for key, text in named:
        if not covers(specs, entrant_spec(text), job.run.name, job.model.base):
            raise JobError(f"{src}: key '{key}' has value {text!r}: not one of league.entrants ({cfg.entrants})")
    if cfg.every and not job.ratings.bootstrap:
        raise JobError(f"{src}: key 'ratings.bootstrap' has value 0: the league (league.every = {cfg.every}) "
                       f"separates entrants by bootstrap resamples; set it to 100 or more")


def _check_algorithm(job: Job) -> None:
    """What the chosen algorithm's SPEC requires of the rest of the job."""
    learn, spec = job.learn, algorithms.spec(job.learn.algorithm)
    if spec.needs_groups and job.round.group_size < 2:
        raise JobError(f"{job.source}: key 'learn.algorithm' has value {learn.algorithm!r}: its advantages compare "
                       f"G attempts of one start state; set round.group_size >= 2 (it is {job.round.group_size})")
    if spec.behaviour_logprobs and job.model.lora.dropout > 0:
        raise JobError(f"{job.source}: key 'model.lora.dropout' has value {job.model.lora.dropout}: "
                       f"{learn.algorithm}'s ratio pi/pi_old is 1 before the first step only without dropout in the "
                       "learner's forward passes; set it to 0")
    if learn.max_train_len is not None and learn.max_train_len <= job.model.max_new_tokens:
        raise JobError(f"{job.source}: key 'learn.max_train_len' has value {learn.max_train_len}: it must hold a whole "
                       f"completion (model.max_new_tokens = {job.model.max_new_tokens}) and a prompt token, or the "
                       "learner trains on cut completions (at 1: on nothing)")
    if isinstance(learn.window, int) and learn.window - 1 > learn.max_staleness and spec.rows == "played":
        raise JobError(f"{job.source}: key 'learn.window' has value {learn.window}: its oldest round can be "
                       f"{learn.window - 1} learner iterations old, more than learn.max_staleness = "
                       f"{learn.max_staleness}; raise learn.max_staleness or shrink the window")


def check_learn_sql(job: Job) -> None:
    """Parse every reward transform and run the learner's batch query on the lake's typed, empty
    tables, so a misspelt transform, one in the wrong stage, a missing column or bad SQL fails
    when the job is loaded, with no lake present, not after a round was played."""
    # Imported here: these modules import this one.
    from unstable_dask.lake.read import connect_empty
    from unstable_dask.learn.learner import build_query
    from unstable_dask.learn.plan import Plan
    from unstable_dask.learn.rewards import batch_query, run_batch_query
    from unstable_dask.learn.transforms import STAGES, ExpertMove, parse_transform

    cfg, run_name = job.learn, job.run.name
    if algorithms.spec(cfg.algorithm).rows == "selected":
        return _check_select(job)
    texts = {"final": cfg.final_transforms, "step": cfg.step_transforms, "sampling": cfg.sampling_transforms}

    def error(stage: str, i: int, e: JobError) -> JobError:
        why = str(e).split(": ", 1)[-1]  # drop the message's own key prefix
        return JobError(f"{job.source}: key 'learn.{stage}_transforms[{i}]' has value {texts[stage][i]!r}: {why}")

    con = connect_empty()
    try:
        parsed: dict[str, list] = {stage: [] for stage in STAGES}
        for stage in STAGES:
            for i, text in enumerate(texts[stage]):
                try:
                    parsed[stage].append(parse_transform(text, stage, con))
                except JobError as e:
                    raise error(stage, i, e) from None
        for i, t in enumerate(parsed["step"]):
            wrong = [e.env_id for e in job.round.train_envs if isinstance(t, ExpertMove) and not solves(t.expert, e.env_id)]
            if wrong:
                raise error("step", i, JobError(f"{t.expert} has a solver for {' and '.join(SOLVES[t.expert])} only, "
                                                f"and the job trains on {wrong[0]}"))
        try:  # the query the learner runs, algorithm-specific steps included
            run_batch_query(con, build_query(job, Plan(run_name, 1, "ckpt-1", "base", None, [0]), 0, con))
            if algorithms.spec(cfg.algorithm).sampling_on == "advantages":  # A2C: its sampling SQL reads the batch
                run_batch_query(con, batch_query(run_name, [0], cfg.batch_size, 0, parsed["final"], parsed["step"], parsed["sampling"]))
            return
        except JobError as whole:
            failed = whole
        # Name the first transform whose query fails: the pipelines up to each one in turn.
        upto: dict[str, list] = {stage: [] for stage in STAGES}
        for stage in STAGES:
            for i, t in enumerate(parsed[stage]):
                upto[stage].append(t)
                try:
                    run_batch_query(con, batch_query(run_name, [0], cfg.batch_size, 0, upto["final"], upto["step"], upto["sampling"]))
                except JobError as e:
                    raise error(stage, i, e) from None
        raise JobError(f"{job.source}: key 'learn': {failed}")
    finally:
        con.close()


def _check_select(job: Job) -> None:
    """The SELECT of an algorithm of selected rows (SFT), run on the lake's typed, empty tables."""
    from unstable_dask.lake.read import connect_empty
    from unstable_dask.learn.learner import build_query, run_batch
    from unstable_dask.learn.plan import Plan
    from unstable_dask.learn.selection import check_select
    select = cast(Any, job.learn).select
    con = connect_empty()
    try:
        check_select(con, select)
        run_batch(con, job, build_query(job, Plan(job.run.name, 1, "ckpt-1", "base", None, [0]), 0, con))
    except JobError as e:
        why = str(e).split(": ", 1)[-1]  # drop the message's own key prefix
        raise JobError(f"{job.source}: key 'learn.select' has value {select!r}: {why}") from None
    finally:
        con.close()


def load_job(path: Union[str, Path, None] = None, overrides: Optional[dict] = None) -> Job:
    """Read and validate a job file; no path means the embedded default job.

    A path that is not a file but names a shipped job (`demo`, `jobs/smollm2-cpu.toml`, ...) reads
    the copy inside the installed package, so the README's commands work outside a checkout too.
    """
    # The embedded default is the demo, on the hf engine: vLLM's start (25-50 s) would make its
    # 11 s round several times longer (docs/engines.md).
    raw: dict = {"model": {"backend": "hf"}}
    source = "<default>"
    if path is not None:
        p = Path(path)
        source = str(p)
        if not p.is_file():
            p = shipped_job(p)
        try:
            raw = tomllib.loads(p.read_text(encoding="utf-8"))
        except tomllib.TOMLDecodeError as e:
            raise JobError(f"{source}: not valid TOML ({e})") from None
        except UnicodeDecodeError:
            raise JobError(f"{source}: not a UTF-8 text file") from None
    for dotted, value in (overrides or {}).items():
        node = raw
        *parents, leaf = dotted.split(".")
        for k in parents:
            node = node.setdefault(k, {})
        node[leaf] = value
    return validate_job(raw, source)


def shipped_jobs() -> dict[str, Path]:
    """The job files installed with the package (unstable_dask/jobs, the repo's jobs/ folder)."""
    return {f.stem: f for f in sorted((Path(__file__).parent / "jobs").glob("*.toml"))}


def shipped_job(path: Path) -> Path:
    jobs = shipped_jobs()
    if str(path.parent) in (".", "jobs") and path.stem in jobs and path.suffix in ("", ".toml"):
        return jobs[path.stem]
    raise JobError(f"{path}: job file not found (shipped jobs: {', '.join(jobs) or 'none'})")


def default_job() -> Job:
    return load_job(None)
