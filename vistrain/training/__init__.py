"""Self-supervised pre-training: the plain training loop ``train(cfg)`` run on every rank."""

from vistrain.training.trainer import train

__all__ = ["train"]
