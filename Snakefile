from snakemake.utils import min_version

min_version("9.0")


configfile: "config/config.yaml"


include: "workflow/rules/common.smk"
include: "workflow/rules/demo_data.smk"
include: "workflow/rules/preprocess.smk"


rule all:
    default_target: True
    input:
        preprocessed_outputs(),
