"""The task holder and the semaphore slot key: each written and read in one place."""

from __future__ import annotations

import os
import socket

from coordination.contrib.execution import holder_name
from coordination.holders import parse_task_holder, task_holder
from coordination.models import HOLDER_MAX_LENGTH
from coordination.semaphores import parse_slot_key, permit_keys, slot_key


def test_a_task_holder_reads_back_as_it_was_written() -> None:
    holder = holder_name("app.tasks.deposit", "6dec905c", 2)
    assert holder == f"app.tasks.deposit[6dec905c]#2 on {socket.gethostname()}:{os.getpid()}"
    parsed = parse_task_holder(holder)
    assert parsed is not None
    assert (parsed.task, parsed.task_id, parsed.attempt) == ("app.tasks.deposit", "6dec905c", 2)
    assert parsed.short_name == "deposit"
    assert parsed.rest == f" on {socket.gethostname()}:{os.getpid()}"


def test_a_long_task_holder_is_cut_and_still_reads() -> None:
    holder = task_holder("app.tasks." + "x" * 300, None, 1, max_length=HOLDER_MAX_LENGTH)
    assert len(holder) == HOLDER_MAX_LENGTH and holder.endswith("~")
    assert parse_task_holder(holder) is None  # cut inside the name: no longer a task's
    short = task_holder("t", None, 1, max_length=HOLDER_MAX_LENGTH)
    parsed = parse_task_holder(short)
    assert parsed is not None and parsed.task_id == "direct"


def test_other_holders_are_no_task_holders() -> None:
    assert parse_task_holder("worker-A") is None
    assert parse_task_holder("beat vm:12") is None


def test_a_slot_key_reads_back_as_it_was_written() -> None:
    assert slot_key("mail", 3) == "mail@3"
    assert permit_keys("mail", 2) == ["mail@1", "mail@2"]
    assert parse_slot_key("mail@3") == ("mail", 3)
    assert parse_slot_key("a@b@12") == ("a@b", 12)
    assert parse_slot_key("mail@*") is None
    assert parse_slot_key("mail@0") is None
    assert parse_slot_key("mail") is None
