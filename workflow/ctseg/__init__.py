"""ctseg: 3D CT segmentation with offline targets, staged data and measured loader phases."""

__version__ = "0.1.0"
