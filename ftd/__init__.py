"""ftd: a fault-tolerance supervisor for distributed PyTorch training."""

__version__ = "0.1.0"
