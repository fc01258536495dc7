"""Proof under faults: a chaos workload, its history and the checker that judges it.

- :mod:`~project.lab.chaos.history`: the JSON lines every operation is logged as.
- :mod:`~project.lab.chaos.worker`: one worker process taking locks and writing
  through the fences (or, for the negative control, around them).
- :mod:`~project.lab.chaos.faults`: pauses, kills, killed connections and
  restarts of a PostgreSQL server the run manages itself.
- :mod:`~project.lab.chaos.checker`: the rules of docs/rules.md, checked
  over a whole history; usable on its own (``python -m project.lab.chaos.checker
  history.jsonl``).
- :mod:`~project.lab.chaos.run`: the controller behind ``manage.py coordination_chaos``.
"""
