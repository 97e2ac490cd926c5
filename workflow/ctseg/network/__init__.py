"""The network and what is counted of it: the 3D U-Net (`model`), the loss terms (`losses`), the
counted FLOPs and efficiency (`flops`), the datasheet and measured peaks (`peaks`), and
`ctseg model-summary`'s table (`summary`).

May import: the shared top level.
"""
