"""Preparation of a dataset, before any training: TIFF to Zarr (`convert`), the offline training
targets (`targets`), the staged scratch copy (`stage`) and the generated demo datasets
(`demo_data`, `demo_realistic`, `demo_volume`). The dataset's csv files and an experiment's
record selection are `ctseg.records`, at the top level, because the run model builds on them.

May import: the shared top level (`ctseg.io`, `ctseg.store`, `ctseg.layout`, `ctseg.records`, ...).
"""
