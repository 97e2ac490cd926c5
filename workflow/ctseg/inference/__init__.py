"""Sliding-window inference of volumes to probabilities (`infer`) and the weighted mean of several
runs' probabilities (`ensemble`).

May import: the shared top level, `ctseg.preprocess`, `ctseg.data`, `ctseg.network`,
`ctseg.training` (a trained run's weights and device choice), `ctseg.postprocess` and
`ctseg.evaluation`.
"""
