"""boundedloss: a bounded-loss gradient transport over UDP for data-parallel training."""

__version__ = "0.1.0"
