"""`python -m memlm.train --cfg job|hydra|all` (or `-c ...`): print the configuration, train nothing.

    mode, overrides = split_cfg_flag(argv)   # mode None: no --cfg, train
    print(render(mode, overrides))

Hydra apps built on @hydra.main print, for --cfg: job = the app's config,
hydra = Hydra's own config, all = both (the latter under a `hydra:` key).
memlm composes with Hydra's compose API (memlm.config.run.compose), not
@hydra.main, so Hydra's runtime settings (run/sweep output folders, job
logging, launcher, sweeper) are never used: a run writes into its dump_dir
and logs through memlm. What memlm prints:

- job: the composed config, validated and with interpolations resolved
  (what the run gets and saves in its checkpoints);
- hydra: the part of Hydra's config that describes this composition: the
  preset chosen in each config group (runtime.choices), the overrides
  (overrides.task), the config name, its search path and Hydra's version;
- all: job, then that under `hydra:`.

`--cfg` with no value is job (memlm's earlier spelling); `--resolve` is
accepted and changes nothing (memlm always resolves).
"""

from __future__ import annotations

from collections.abc import Sequence

from memlm.errors import ConfigError

CFG_MODES = ("job", "hydra", "all")
CFG_FLAGS = ("--cfg", "-c")
NOT_USED = ("# memlm composes with Hydra's compose API, not @hydra.main: Hydra's run/sweep folders, job logging,\n"
            "# launcher and sweeper are not used (a run writes into its dump_dir). Shown: the composition.\n")


def split_cfg_flag(argv: Sequence[str]) -> tuple[str | None, list[str]]:
    """(the --cfg mode, or None without the flag; the other arguments).
    `--cfg MODE`, `--cfg=MODE`, `-c MODE`, or a bare `--cfg`/`-c` (job)."""
    mode, rest, args = None, [], list(argv)
    i = 0
    while i < len(args):
        arg = args[i]
        flag, eq, value = arg.partition("=")
        if flag in CFG_FLAGS and eq:  # --cfg=job
            if value not in CFG_MODES:
                raise ConfigError(flag, value, f"one of: {', '.join(CFG_MODES)}")
            mode = value
        elif arg in CFG_FLAGS:
            nxt = args[i + 1] if i + 1 < len(args) else None
            if nxt in CFG_MODES:
                mode, i = nxt, i + 1
            elif nxt is not None and "=" not in nxt and not nxt.startswith("-"):
                raise ConfigError(arg, nxt, f"one of: {', '.join(CFG_MODES)} (nothing: job)")
            else:
                mode = "job"
        elif arg != "--resolve":
            rest.append(arg)
        i += 1
    return mode, rest


def hydra_section(overrides: Sequence[str]) -> dict:
    """What Hydra records about composing configs/ with these overrides (call
    after memlm.config.run.compose accepted them)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from memlm.config.run import CONFIG_DIR

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3", job_name="memlm"):
        hydra = compose(config_name="config", overrides=list(overrides), return_hydra_config=True).hydra
    choices = OmegaConf.to_container(hydra.runtime.choices)
    sources = OmegaConf.to_container(hydra.runtime.config_sources)
    return {
        "overrides": {"task": list(hydra.overrides.task)},
        "job": {"config_name": hydra.job.config_name},
        "runtime": {
            "version": hydra.runtime.version,
            "choices": {g: c for g, c in choices.items() if not g.startswith("hydra/")},  # Hydra's own: unused
            "config_sources": [s for s in sources if s["provider"] != "hydra"],
        },
    }


def render(mode: str, overrides: Sequence[str]) -> str:
    """The text `--cfg mode` prints (YAML; hydra and all start with a comment
    saying what memlm leaves out). Raises ConfigError for invalid overrides."""
    from omegaconf import OmegaConf

    from memlm.config.run import compose, to_yaml

    if mode not in CFG_MODES:
        raise ConfigError("--cfg", mode, f"one of: {', '.join(CFG_MODES)}")
    job = to_yaml(compose(overrides))  # validates first: a bad override fails as in training
    if mode == "job":
        return job
    hydra = OmegaConf.to_yaml({"hydra": hydra_section(overrides)})
    return NOT_USED + (hydra if mode == "hydra" else job + hydra)
