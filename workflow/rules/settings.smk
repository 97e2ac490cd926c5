import sys

from snakemake.utils import validate

from ctseg.cluster import check_placeholders
from ctseg.config import CONFIG_FILE, command_line_values, load_config, read_yaml
from ctseg.io import CtsegError


def refuse(message):
    """Stop planning with one line on the console, naming the file and the problem: no
    traceback, which would only point into the workflow's own code."""
    print(f"ctseg: {message}", file=sys.stderr)
    raise SystemExit(1)


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


def check_config():
    """Nested --config values read as YAML (so `--config 'infer={threshold: 0.3}'` sets one
    key), then one line naming the key and the problem for anything the schema refuses.
    """
    command_line_values(config)
    try:
        load_config(config, f"{CONFIG_FILE} with --config")
    except CtsegError as exc:
        hint = ""
        if "is not of type" in str(exc):
            hint = (
                ". A nested key is set with e.g. --config 'infer={threshold: 0.3}' "
                "(the section's other keys keep their values)"
            )
        refuse(f"{exc}{hint}")


check_config()
validate(config, schema="../schemas/config.schema.yaml")


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
