"""A password hasher that takes its time and counts its checks: parallel logins overlap.

Used by the lockout tests, which assert how many passwords were checked.
"""

from __future__ import annotations

import threading
import time

from django.contrib.auth.hashers import MD5PasswordHasher

_lock = threading.Lock()
checks = 0


class SlowCountingHasher(MD5PasswordHasher):
    algorithm = "slow_counting_md5"
    seconds = 0.5

    def verify(self, password: str, encoded: str) -> bool:
        global checks
        with _lock:
            checks += 1
        time.sleep(self.seconds)  # a slow hash: every parallel request is inside it at once
        return super().verify(password, encoded)

    def harden_runtime(self, password: str, encoded: str) -> None:
        pass

    def must_update(self, encoded: str) -> bool:
        return False


def reset() -> None:
    global checks
    with _lock:
        checks = 0
