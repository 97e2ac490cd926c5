import dataclasses
import sys

from snakemake.utils import validate

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
from ctseg.postprocess.masks import PostprocessSettings
from ctseg.postprocess.tuning import SearchSpace
from ctseg.preprocess.stage import expand_scratch
from ctseg.runs import yaml_names


def refuse(message):
    """Stop planning with one line on the console, naming the file and the problem: no
    traceback, which would only point into the workflow's own code."""
    print(f"ctseg: {message}", file=sys.stderr)
    raise SystemExit(1)


def config_source():
    """Where the config's values come from, as an error names it: config/config.yaml, and any
    --configfile or --config given on the command line."""
    settings = workflow.config_settings
    source = CONFIG_FILE
    for path in settings.configfiles:
        source += f" with --configfile {path}"
    return source + (" with --config" if settings.config else "")


def check_config_files():
    """A one-line error naming the file, line and problem (a key given twice included), before
    Snakemake's own loader says only that the file is not valid YAML, or keeps the last of two
    keys without a word."""
    for path in [CONFIG_FILE, *workflow.config_settings.configfiles]:
        try:
            read_yaml(path)
        except CtsegError as exc:
            refuse(exc)


check_config_files()


configfile: CONFIG_FILE


def choices(key):
    """What a top-level key whose values are named in other files may be, listed in full; None
    for any other key (the schema's message says it)."""
    if key == ("phase",):
        try:
            phases = sorted(load_phases(PHASES_FILE))
        except CtsegError as exc:
            refuse(exc)
        return f"expected a phase of {PHASES_FILE} ({phases}), or auto"
    if key == ("experiment",):
        return (
            f"expected a run, or a list of runs: an experiment of {EXPERIMENTS_DIR}/ "
            f"({yaml_names(EXPERIMENTS_DIR)}), a fold <experiment>.fold<i>, a "
            f"cross-validation <experiment>.cv, or an ensemble of {ENSEMBLES_DIR}/ "
            f"({yaml_names(ENSEMBLES_DIR)})"
        )
    return None


def check_config():
    """Nested --config values read as YAML (so `--config 'infer={threshold: 0.3}'` sets one
    key), then one line naming the key and the problem for anything the schema refuses.
    Returns the config with its defaults filled in.
    """
    command_line_values(config)
    try:
        return load_config(config, config_source())
    except SettingError as exc:
        expected = choices(exc.key)
        if expected is not None:
            value = "no value" if exc.value is None else repr(exc.value)
            refuse(f"{config_source()}: {'.'.join(exc.key)}: {value}: {expected}")
        hint = ""
        if "is not of type" in str(exc) and workflow.config_settings.config:
            hint = (
                ". A nested key is set with e.g. --config 'infer={threshold: 0.3}' "
                "(the section's other keys keep their values)"
            )
        refuse(f"{exc}{hint}")


def check_postprocess(infer):
    """The fixed post-processing values and the search space of config `infer`, checked by the
    very classes the postprocess and tune_postprocess jobs build from them, so that a bad
    combination (hysteresis_high below threshold, hysteresis_mode z without hysteresis_high, a
    pair [high, low]) stops planning, not a job after training and inference. Both are checked
    whichever infer.postprocess uses, as every other value of the config is."""
    fixed = {f.name: infer[f.name] for f in dataclasses.fields(PostprocessSettings)}
    try:
        PostprocessSettings(**fixed)
    except CtsegError as exc:
        refuse(f"{config_source()}: infer: {exc}")

    def as_tuples(value):
        # The search space's values as `ctseg tune-postprocess` gives them: lists as tuples.
        return tuple(as_tuples(v) for v in value) if isinstance(value, list) else value

    try:
        SearchSpace(**{key: as_tuples(value) for key, value in infer["tune"].items()})
    except CtsegError as exc:
        refuse(f"{config_source()}: infer.tune: {exc}")


check_postprocess(check_config()["infer"])
validate(config, schema="../schemas/config.schema.yaml")


def configured_scratch():
    """Config `scratch` with its $VARS expanded here, where stage runs; an unset one (as
    `$TMPDIR` outside a cluster job) stops planning with the key named."""
    try:
        return expand_scratch(config["scratch"])
    except CtsegError as exc:
        refuse(
            f"{config_source()}: {exc}; export the variable, or set scratch to a directory "
            "(e.g. --config scratch=results/scratch)"
        )


def check_profile():
    """A profile's placeholders (CHANGE_ME in workflow/profiles/slurm) refused before any job is
    submitted: a cluster without accounting would accept `-A CHANGE_ME`."""
    settings = workflow.resource_settings

    def raw(resources):  # the values as written, before Snakemake evaluates them
        return {k: getattr(r, "raw", r) for k, r in (resources or {}).items()}

    try:
        check_placeholders(
            raw(settings.default_resources),
            {rule: raw(r) for rule, r in settings.overwrite_resources.items()},
            sys.argv,
        )
    except CtsegError as exc:
        refuse(exc)


check_profile()
