"""Build the plans of `ctseg.plan` from the dataset and the configuration.

- `dataset_plan`: the label spec from ``resources/<name>/dataset.yaml`` (the Kaggle spec without
  one) and the voxel spacing: dataset.yaml's ``spacing``, else the TIFF tags of the dataset's
  first image where they record all three axes (`ctseg.preprocess.spacing.tiff_spacing`), else
  isotropic. One spacing holds for the whole dataset (ctseg does not resample).
- `run_plan`: one run's experiment (fold applied) with its patch resolved, its network's output
  channels set from the labels (1 binary, K+1 multi-class) and its loss terms checked against
  them (`ctseg.network.terms.check_terms`), and its phase. An
  experiment's ``data.patch_size: auto`` is planned from the spacing and the images' median
  shape, within ``data.patch_voxels`` voxels (`ctseg.network.patch_plan.plan_patch`), in
  multiples of the network's downsampling. ``data.augment.spacing`` is filled with an
  anisotropic dataset's spacing relative to its finest axis (null, the schema's isotropic,
  otherwise), so that augmentation only swaps axes of equal spacing
  (`ctseg.data.augment.permutable_groups`).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from ctseg.config import Experiment, Phase, experiment_from, thaw
from ctseg.io import CtsegError
from ctseg.labels import DATASET_FILE, load_dataset_spec
from ctseg.network.patch_plan import plan_patch
from ctseg.network.sizes import computed_patch, config_size_multiple
from ctseg.network.terms import check_terms
from ctseg.plan import ISOTROPIC, DatasetPlan, PatchPlan, PhasePlan, RunPlan
from ctseg.preprocess.spacing import tiff_spacing

AUTO = "auto"


def dataset_plan(dataset_dir: str | Path, first_image: str | Path | None) -> DatasetPlan:
    """The dataset's labels and spacing (module docstring). `first_image`: the TIFF (file or
    folder of slices) whose tags give the spacing where dataset.yaml does not; None or a file
    not written yet (the demo's, before its data job) gives none."""
    spec = load_dataset_spec(dataset_dir)
    if spec.labels.regions:
        # Parsed and checked (ctseg.labels), but no stage trains regions: refused, not ignored.
        raise CtsegError(
            f"{Path(dataset_dir) / DATASET_FILE}: regions: region-based training (a channel "
            "per set of labels) is not supported; remove regions to train the labels as classes"
        )
    if spec.spacing is not None:
        return DatasetPlan(spec.labels, spec.spacing, str(Path(dataset_dir) / DATASET_FILE))
    if first_image is not None and Path(first_image).exists():
        tagged = tiff_spacing(first_image)
        if tagged is not None:
            return DatasetPlan(spec.labels, tagged, f"TIFF tags of {first_image}")
    return DatasetPlan(spec.labels, ISOTROPIC, "isotropic: no dataset.yaml spacing, no TIFF tags")


def median_shape(shapes: Sequence[Sequence[int]]) -> tuple[int, int, int]:
    """The per-axis median of the images' shapes (z, y, x), as nnU-Net's fingerprint takes it."""
    if not shapes:
        raise CtsegError("patch_size auto: no image shapes to plan from")
    return tuple(int(statistics.median(s[axis] for s in shapes)) for axis in range(3))  # type: ignore[return-value]


def run_plan(
    run: str,
    exp: Experiment,
    dataset: DatasetPlan,
    *,
    phase: int | str,
    phases: Mapping[int, Phase],
    image_shapes: Callable[[], Sequence[Sequence[int]]],
    where: str,
) -> RunPlan:
    """`run`'s plan: `exp` (its effective settings, fold applied) with the patch and the
    augmentation's spacing resolved, the dataset's section, and the configured `phase`.
    `image_shapes` is asked only for a planned patch. `where`: the experiment's file, named
    by an error."""
    data = thaw(exp["data"])
    augment = data.setdefault("augment", {})
    if augment.get("spacing") is not None:
        raise CtsegError(
            f"{where}: data.augment.spacing is the dataset's, set by the plan; give the voxel "
            f"spacing as `spacing: [z, y, x]` in the dataset's {DATASET_FILE}"
        )
    if not dataset.isotropic:  # isotropic: null, as the schema's default means
        augment["spacing"] = list(dataset.relative_spacing)
    try:
        check_terms(exp["loss"]["weights"], labels=dataset.labels)
    except CtsegError as exc:
        raise CtsegError(f"{where}: {exc}") from exc
    model = thaw(exp["model"])
    model["out_channels"] = dataset.labels.out_channels  # 1 binary, K+1 multi-class
    multiple = config_size_multiple(exp["model"])
    planned = data["patch_size"] == AUTO
    if planned:
        size = plan_patch(
            dataset.spacing, median_shape(image_shapes()), int(data["patch_voxels"]), multiple
        )
        data["patch_size"] = list(size)
    size = tuple(int(s) for s in data["patch_size"])
    experiment = experiment_from({**thaw(exp), "data": data, "model": model}, where)
    settings = None if phase == AUTO else phases[int(phase)]
    configured: int | str = AUTO if phase == AUTO else int(phase)
    return RunPlan(
        run=run,
        dataset=dataset,
        experiment=experiment,
        patch=PatchPlan(size, computed_patch(size, multiple), planned),  # type: ignore[arg-type]
        phase=PhasePlan(configured, settings),
    )


def image_shapes_of(sources: Sequence[str | Path]) -> list[tuple[int, ...]]:
    """The shapes of TIFF volumes (a multi-page file or a folder of slices) from their headers:
    no pixel is read."""
    import tifffile

    shapes = []
    for source in sources:
        path = Path(source)
        try:
            if path.is_dir():
                slices = sorted(p for p in path.iterdir() if p.suffix.lower() in (".tif", ".tiff"))
                if not slices:
                    raise CtsegError(f"{path}: no .tif slices in the folder")
                with tifffile.TiffFile(slices[0]) as tif:
                    shapes.append((len(slices), *tif.series[0].shape[-2:]))
            else:
                with tifffile.TiffFile(path) as tif:
                    shapes.append(tuple(tif.series[0].shape[-3:]))
        except (OSError, tifffile.TiffFileError) as exc:
            raise CtsegError(
                f"{path}: cannot read the TIFF header for the patch plan ({exc})"
            ) from exc
    return shapes
