"""Phase trials: a short measured run per loader phase, its figures and verdict (`trials`,
`diagnosis`), the kernel profile (`kernel_profile`), and the phase `auto` picks.

May import: the shared top level, `ctseg.preprocess`, `ctseg.data`, `ctseg.network` and
`ctseg.training`.
"""
