"""factory-boy factories for test data."""

from __future__ import annotations

from decimal import Decimal

import factory

from coordination.models import Fence, Lock
from project.demo.models import Account


class AccountFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Account

    owner = factory.Sequence(lambda n: f"owner-{n}")
    balance = Decimal("100.00")


class LockFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Lock

    key = factory.Sequence(lambda n: f"job:{n}")


class FenceFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Fence

    resource = factory.Sequence(lambda n: f"mailbox-{n}")
    lock_key = factory.Sequence(lambda n: f"mailer:{n}")
