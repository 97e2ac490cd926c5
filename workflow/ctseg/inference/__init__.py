"""Trained runs applied to volumes: the settings (`settings`), the window maths (`windows`), one
volume to probabilities (`volume`), a run's weights and records (`run`), the weighted mean of
several runs' probabilities (`ensemble`), and new volumes in one command (`inputs`, `predict`).

May import: the shared top level, `ctseg.preprocess`, `ctseg.data`, `ctseg.network`,
`ctseg.training` (a trained run's weights and device choice), `ctseg.postprocess` and
`ctseg.evaluation`.
"""
