"""Planning models with dynamic tables, one job a module:

- :mod:`~dynemb.planning.footprint`: the bytes one rank spends on one table
  (:func:`~dynemb.planning.footprint.table_footprint`), from the table layer's sizing rules;
- :mod:`~dynemb.planning.estimators`: TorchRec's planner using it (estimators, stats,
  constraints, :func:`~dynemb.planning.estimators.make_planner`);
- :mod:`~dynemb.planning.report`: footprints and measured allocations as text.

Import the public names from :mod:`dynemb.planner`.
"""
