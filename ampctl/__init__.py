"""ampctl: protected mixed-precision training."""

__version__ = "0.1.0"
