from snakemake.utils import validate

from ctseg.config import CONFIG_FILE, command_line_values, load_config, read_yaml
from ctseg.io import CtsegError


def check_config_file(path):
    """A one-line error naming the file, line and problem, before Snakemake's own loader says
    only that the file is not valid YAML."""
    try:
        read_yaml(path)
    except CtsegError as exc:
        raise WorkflowError(str(exc)) from exc


check_config_file(CONFIG_FILE)


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
        raise WorkflowError(f"{exc}{hint}") from exc


check_config()
validate(config, schema="../schemas/config.schema.yaml")
