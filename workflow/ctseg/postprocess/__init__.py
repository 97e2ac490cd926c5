"""Probabilities to masks (`masks`) and the search for the post-processing settings by the exact
score (`tuning`).

May import: the shared top level and `ctseg.evaluation`.
"""
