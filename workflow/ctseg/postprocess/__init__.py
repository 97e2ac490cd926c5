"""Probabilities to masks (`masks`), the mask written in the submission layout (`write`), and the
search for the post-processing settings by the exact score (`tuning`).

May import: the shared top level and `ctseg.evaluation`.
"""
