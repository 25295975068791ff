"""vistrain: self-supervised vision pretraining with a built-in fully sharded data parallel engine."""

__version__ = "0.1.0"
