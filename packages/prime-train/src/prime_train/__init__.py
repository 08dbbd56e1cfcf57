"""prime_train: the DiLoCo trainer."""

__version__ = "0.1.0"
