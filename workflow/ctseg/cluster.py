"""Checks on the cluster profile that Snakemake cannot make itself.

The SLURM profile (workflow/profiles/slurm/config.yaml) ships placeholders for what only the
user knows: the account and the partitions. Left as they are, a cluster without accounting
accepts `-A CHANGE_ME` and a wrong partition fails job by job; the workflow refuses them before
anything is submitted instead.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from ctseg.io import CtsegError

PLACEHOLDER = "CHANGE_ME"
PROFILE_OPTIONS = ("--workflow-profile", "--profile")


def profile_file(argv: Sequence[str]) -> str:
    """The profile's config.yaml as the command line names it, for the error message."""
    for i, arg in enumerate(argv):
        for option in PROFILE_OPTIONS:
            if arg == option and i + 1 < len(argv):
                return str(Path(argv[i + 1]) / "config.yaml")
            if arg.startswith(option + "="):
                return str(Path(arg.split("=", 1)[1]) / "config.yaml")
    return "the profile (--workflow-profile)"


def placeholders(
    default_resources: Mapping[str, object], set_resources: Mapping[str, Mapping[str, object]]
) -> list[str]:
    """Where a resource is still the placeholder, as `default-resources: KEY` or
    `set-resources: RULE: KEY`, in the profile's order."""
    found = [
        f"default-resources: {key}"
        for key, value in default_resources.items()
        if str(value).strip() == PLACEHOLDER
    ]
    for rule, resources in set_resources.items():
        found += [
            f"set-resources: {rule}: {key}"
            for key, value in resources.items()
            if str(value).strip() == PLACEHOLDER
        ]
    return found


def check_placeholders(
    default_resources: Mapping[str, object],
    set_resources: Mapping[str, Mapping[str, object]],
    argv: Sequence[str] = (),
) -> None:
    """One line naming the profile, every resource left at the placeholder, and the fix."""
    found = placeholders(default_resources, set_resources)
    if found:
        raise CtsegError(
            f"{profile_file(argv)}: the placeholder {PLACEHOLDER!r} is still in "
            f"{'; '.join(found)}: set each to your cluster's value (the lines marked EDIT, "
            'docs/cluster.md "What to edit in the profile"), or to "" for the cluster\'s '
            "default"
        )
