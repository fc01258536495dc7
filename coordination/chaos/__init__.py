"""Proof under faults: a chaos workload, its history and the checker that judges it.

- :mod:`~coordination.chaos.history`: the JSON lines every operation is logged as.
- :mod:`~coordination.chaos.worker`: one worker process taking locks and writing
  through the fences (or, for the negative control, around them).
- :mod:`~coordination.chaos.faults`: pauses, kills, killed connections and
  restarts of a PostgreSQL server the run manages itself.
- :mod:`~coordination.chaos.checker`: the rules of docs/rules.md, checked
  over a whole history; usable on its own (``python -m coordination.chaos.checker
  history.jsonl``).
- :mod:`~coordination.chaos.run`: the controller behind ``manage.py coordination_chaos``.
"""
