"""The planner: what a run will hold and send per rank, predicted from its config, and the knobs
that fit a memory budget.

- ``shape``: the one typed input both models read (:class:`RunShape`: the model's units and
  their sizes, the dtypes of gathers and reductions, the process groups), built from a config
  and a :class:`ModelShapes` (what is measured of the model once, on the meta device).
- ``memory``: peak bytes per rank (:func:`plan`), the ``mem`` a run logs.
- ``traffic``: bytes per rank and step by process group and across nodes (:func:`traffic`).
- ``knobs``: exact and result knobs, their measured speed, the budget search (:func:`search`).
- ``auto_tune``: ``MODEL.FSDP_CONFIG.AUTO_TUNE``, the run choosing its exact knobs (:func:`tune_run`).

``tools/plan_memory.py`` prints all of it for a recipe.
"""
