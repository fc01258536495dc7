"""The admin's election pages: roles with their leader and term, the history of
terms, and beat slots filtered by state (sent, claimed, lost)."""

from __future__ import annotations

import datetime as dt
import re

import pytest
from django.test import Client
from django.urls import reverse

from coordination import election, locks
from coordination.contrib.beat import claim_slot, mark_sent
from coordination.models import BeatSlot

pytestmark = pytest.mark.django_db

ROLES = "admin:coordination_role_changelist"
SLOTS = "admin:coordination_beatslot_changelist"
DUE = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)


def test_roles_list_shows_the_leader_and_term_and_links_the_history_of_terms(admin_client: Client) -> None:
    old = election.campaign("nightly", candidate="host-a", ttl=30, keepalive=False)
    old.resign()
    leadership = election.campaign("nightly", candidate="host-b", ttl=30, keepalive=False)
    locks.acquire("job:not-a-role", holder="w", ttl=30)
    page = admin_client.get(reverse(ROLES)).content.decode()
    assert "nightly" in page and "host-b" in page and "job:not-a-role" not in page
    assert f'<td class="field-term">{leadership.term}</td>' in page
    history = admin_client.get(reverse("admin:coordination_grant_changelist"),
                               {"lock__id__exact": _role_pk("nightly")})
    assert history.status_code == 200
    text = history.content.decode()
    assert "host-a" in text and "host-b" in text and "job:not-a-role" not in text
    leadership.resign()
    assert "no leader" in admin_client.get(reverse(ROLES)).content.decode()


def _role_pk(role: str) -> int:
    from coordination.models import Role

    return Role.objects.get(key=election.role_key(role)).pk


def test_beat_slots_filter_by_sent_claimed_and_lost(admin_client: Client) -> None:
    first = election.campaign("beat", candidate="beat-1", ttl=30, keepalive=False)
    sent = claim_slot(first, entry="sent-entry", task="t", due_at=DUE)
    assert sent is not None
    mark_sent(sent, "task-1")
    claim_slot(first, entry="lost-entry", task="t", due_at=DUE)
    first.resign()  # its term is over: its unsent claim is lost
    second = election.campaign("beat", candidate="beat-2", ttl=30, keepalive=False)
    claim_slot(second, entry="flying-entry", task="t", due_at=DUE)
    assert BeatSlot.objects.count() == 3

    def entries(state: str) -> set[str]:
        page = admin_client.get(reverse(SLOTS), {"state": state}).content.decode()
        return set(re.findall(r'field-entry"><a [^>]*>([^<]+)</a>', page))

    assert entries("sent") == {"sent-entry"}
    assert entries("lost") == {"lost-entry"}
    assert entries("claimed") == {"flying-entry"}
    second.resign()


def test_the_dashboard_shows_each_role_with_its_leader_and_term(admin_client: Client) -> None:
    election.campaign("reports", candidate="host-a", ttl=30, keepalive=False).resign()
    leadership = election.campaign("reports", candidate="host-b", ttl=30, keepalive=False)
    page = admin_client.get(reverse("admin:coordination_dashboard"), {"refresh": 0}).content.decode()
    assert f'data-role="reports" data-term="{leadership.term}"' in page
    assert "host-b" in page
    leadership.resign()
