"""The method layer: a self-supervised method is one file here, registered by name.

``vistrain/methods/<method>.py`` holds everything the method is: its criterion (a
:class:`Criterion`: which crops go to the student and the teacher, the loss call on the tensors of
``vistrain/losses/``, its hooks and state), the head it reads (a :class:`Head`: builder, the
MODEL.HEAD keys it adds, its fp32 units), its config section LOSS.<name> with a comment per key,
the rules and checks of its values, whether it trains a momentum teacher, and the collectives its
loss runs (for the planner). All of it is one :class:`Method` record, ``METHOD``, which
``registry.py`` lists in the flat ``METHODS`` (LOSS.NAME -> Method); ``HEADS`` (MODEL.HEAD.NAME ->
Head) follows from it. The trainer, the planner, the runtime and the checkpoint code ask these
records and never name a method.

A run's config comes from here (:func:`load_config`, :func:`get_defaults`, :func:`check_config`):
the config layer below cannot import the methods, so they hand it their keys.
"""

from vistrain.methods.base import Criterion, Head, LossCollective, Method
from vistrain.methods.build import (
    build_head,
    build_loss,
    build_meta_model,
    build_method,
    build_model,
    fp32_units,
)
from vistrain.methods.configuration import (
    check_config,
    get_defaults,
    load_config,
    method_keys,
    method_problem,
    method_rules,
    method_warmups,
)
from vistrain.methods.registry import DEFAULT_METHOD, HEADS, METHODS, head_of, method_of

__all__ = [
    "DEFAULT_METHOD",
    "HEADS",
    "METHODS",
    "Criterion",
    "Head",
    "LossCollective",
    "Method",
    "build_head",
    "build_loss",
    "build_meta_model",
    "build_method",
    "build_model",
    "check_config",
    "fp32_units",
    "get_defaults",
    "head_of",
    "load_config",
    "method_keys",
    "method_of",
    "method_problem",
    "method_rules",
    "method_warmups",
]
