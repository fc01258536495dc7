"""The resource side, one module per concern; import from :mod:`coordination.fencing`.

- :mod:`.models`: ``FencedModel`` (rows that are their own fences) and
  ``WatermarkField``; :mod:`.queryset`: ``FencedQuerySet.fenced_update``;
- :mod:`.conditions`: the watermark rule as the conditions of a fenced UPDATE,
  the one place that says how the statement is put together;
- :mod:`.fences`: ``fence()`` and ``afence()`` over named Fence rows;
- :mod:`.idempotency`: ``idempotent()``;
- :mod:`.rejections`: why a write is refused, and its ``Rejection`` record;
- :mod:`.raising`: ``raise_fence_to_lock()``, for after a restore;
- :mod:`.unfenced`: the audited escape hatch for stale saves;
- :mod:`.keys` and :mod:`.grants`: the lock key guarding a row, and the
  grant a write presents.
"""
