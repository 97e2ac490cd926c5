# The config and the profile, checked as the workflow loads (ctseg.workflow_checks): a problem
# stops planning with one line naming the file (`refuse`), before Snakemake's own messages.
import sys

from snakemake.utils import validate

from ctseg.config import CONFIG_FILE, ENSEMBLES_DIR, EXPERIMENTS_DIR, PHASES_FILE
from ctseg.postprocess.checks import check_infer_config
from ctseg.workflow_checks import check_config, check_config_files, check_profile
from ctseg.workflow_checks import config_source, planning, refuse

check_config_files(workflow.config_settings)


configfile: CONFIG_FILE


planning(check_infer_config, config_source(workflow.config_settings))(
    check_config(config, workflow.config_settings)["infer"]
)
validate(config, schema="../schemas/config.schema.yaml")
check_profile(workflow.resource_settings, sys.argv)
