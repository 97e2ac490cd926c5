"""What the workflow checks of its config and profile as it loads (`workflow/rules/settings.smk`),
and how planning refuses: one line on the console naming the file and the problem, exit status 1,
no traceback (which would only point into the workflow's own code).

Snakemake's own objects are passed in: `workflow.config_settings` (its `configfiles` and the
`--config` values) as `settings`, `workflow.resource_settings` as `resources`, the `config`
dict itself. A check that needs a stage's code is given that stage's function.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn, TypeVar

from ctseg.cluster import check_placeholders
from ctseg.config import (
    CONFIG_FILE,
    ENSEMBLES_DIR,
    EXPERIMENTS_DIR,
    PHASES_FILE,
    SettingError,
    command_line_values,
    load_config,
    load_phases,
    read_yaml,
)
from ctseg.io import CtsegError
from ctseg.runs import yaml_names

F = TypeVar("F", bound=Callable[..., Any])


def say(line: object) -> None:
    """A line on the console while the workflow plans, as the workflow's every line."""
    print(f"ctseg: {line}", file=sys.stderr)


def refuse(message: object) -> NoReturn:
    """Stop planning with one line on the console, naming the file and the problem."""
    say(message)
    raise SystemExit(1)


def planning(function: F, source: str | None = None) -> F:
    """`function` as the rules call it: a CtsegError stops planning with its one line (after
    `source: `, the file the checked values come from, when given)."""

    @functools.wraps(function)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return function(*args, **kwargs)
        except CtsegError as exc:
            refuse(exc if source is None else f"{source}: {exc}")

    return call  # type: ignore[return-value]


def config_source(settings: Any) -> str:
    """Where the config's values come from, as an error names it: config/config.yaml, and any
    --configfile or --config given on the command line."""
    source = CONFIG_FILE
    for path in settings.configfiles:
        source += f" with --configfile {path}"
    return source + (" with --config" if settings.config else "")


def check_config_files(settings: Any) -> None:
    """A one-line error naming the file, line and problem (a key given twice included), before
    Snakemake's own loader says only that the file is not valid YAML, or keeps the last of two
    keys without a word."""
    for path in [CONFIG_FILE, *settings.configfiles]:
        planning(read_yaml)(path)


def choices(key: tuple[str, ...]) -> str | None:
    """What a top-level key whose values are named in other files may be, listed in full; None
    for any other key (the schema's message says it)."""
    if key == ("phase",):
        phases = sorted(planning(load_phases)(PHASES_FILE))
        return f"expected a phase of {PHASES_FILE} ({phases}), or auto"
    if key == ("experiment",):
        return (
            f"expected a run, or a list of runs: an experiment of {EXPERIMENTS_DIR}/ "
            f"({yaml_names(EXPERIMENTS_DIR)}), a fold <experiment>.fold<i>, a "
            f"cross-validation <experiment>.cv, or an ensemble of {ENSEMBLES_DIR}/ "
            f"({yaml_names(ENSEMBLES_DIR)})"
        )
    return None


def check_config(config: dict[str, Any], settings: Any) -> Any:
    """Nested --config values read as YAML (so `--config 'infer={threshold: 0.3}'` sets one
    key; `config` is changed in place), then one line naming the key and the problem for
    anything the schema refuses. Returns the config with its defaults filled in."""
    command_line_values(config)
    try:
        return load_config(config, config_source(settings))
    except SettingError as exc:
        expected = choices(exc.key)
        if expected is not None:
            value = "no value" if exc.value is None else repr(exc.value)
            refuse(f"{config_source(settings)}: {'.'.join(exc.key)}: {value}: {expected}")
        hint = ""
        if "is not of type" in str(exc) and settings.config:
            hint = (
                ". A nested key is set with e.g. --config 'infer={threshold: 0.3}' "
                "(the section's other keys keep their values)"
            )
        refuse(f"{exc}{hint}")


def configured_scratch(
    config: Mapping[str, Any], settings: Any, expand: Callable[[str], Path]
) -> Path:
    """Config `scratch` with its $VARS expanded here, where stage runs (`expand`:
    `ctseg.preprocess.stage.expand_scratch`); an unset one (as `$TMPDIR` outside a cluster
    job) stops planning with the key named."""
    try:
        return expand(config["scratch"])
    except CtsegError as exc:
        refuse(
            f"{config_source(settings)}: {exc}; export the variable, or set scratch to a "
            "directory (e.g. --config scratch=results/scratch)"
        )


def check_profile(resources: Any, argv: Sequence[str]) -> None:
    """A profile's placeholders (CHANGE_ME in workflow/profiles/slurm) refused before any job is
    submitted: a cluster without accounting would accept `-A CHANGE_ME`."""

    def raw(values: Mapping[str, Any] | None) -> dict[str, Any]:
        # The values as written, before Snakemake evaluates them.
        return {k: getattr(r, "raw", r) for k, r in (values or {}).items()}

    planning(check_placeholders)(
        raw(resources.default_resources),
        {rule: raw(r) for rule, r in resources.overwrite_resources.items()},
        argv,
    )
