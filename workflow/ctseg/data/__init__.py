"""Training data: the patch stream read from the scratch copy (`patches`, `augment`), the packed
sample and batch (`packing`), the loader and its shared-memory slots (`loader`, `slots`), a
batch's trip to the device (`device_batches`), and the host-side tuning they rely on (`heap`,
`torch_private`).

May import: the shared top level and `ctseg.preprocess`.
"""
