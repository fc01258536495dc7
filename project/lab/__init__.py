"""The site's lab: the demo, the chaos workload and the benchmarks.

They drive the app from outside, as a user's site would, and need this
repository's site (the demo's ``Account`` model, the ``project`` Celery app), so
they live here and not in the ``coordination`` package:

- ``manage.py coordination_demo``: the seed's timeline with two real Celery workers
  (the task is :func:`project.demo.tasks.deposit`).
- ``manage.py coordination_chaos``: :mod:`project.lab.chaos`, proof under faults.
- ``manage.py coordination_bench``: :mod:`project.lab.benchmarks`, the grant point
  and the fences against their baselines.
"""
