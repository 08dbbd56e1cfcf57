"""prime_mesh: elastic inter-node process groups for training over the internet."""

__version__ = "0.1.0"
