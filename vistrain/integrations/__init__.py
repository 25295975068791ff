"""Bridges from other training frameworks to vistrain's engine and checkpoints.

Each bridge is optional: it needs its framework (a pip extra, e.g. ``pip install
"vistrain[lightning]"``) and is imported only by name (``import vistrain.integrations.lightning``);
importing ``vistrain.integrations`` alone imports no framework.
"""
