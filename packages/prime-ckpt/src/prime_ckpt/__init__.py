"""prime_ckpt: checkpoints that never stall training."""

__version__ = "0.1.0"
