"""The demo domain: bank accounts whose balance is fenced, as in the seed's SQL example::

    UPDATE account SET balance = :balance, fence = :token
    WHERE id = :id AND fence < :token;
"""

from decimal import Decimal

from django.db import models

from coordination.fencing import FencedModel


class Account(FencedModel):
    owner = models.CharField(max_length=100)
    balance = models.DecimalField(max_digits=14, decimal_places=2, default=Decimal("0.00"))

    fence_lock = "account:{pk}"

    class Meta(FencedModel.Meta):
        ordering = ["pk"]

    def __str__(self) -> str:
        return f"{self.owner} ({self.balance})"
