"""The competition score of a volume (`metrics`) and its exact parts: SurfaceDice
(`surface_dice`), Betti matching for TopoScore (`betti_matching`) and clDice's skeletons
(`thinning`).

May import: the shared top level.
"""
