"""Run a command that must meet file permissions as a user does, also when the tests run as root.

Root writes to read-only files and folders by the capability CAP_DAC_OVERRIDE, so a check for
"this path is read-only" would never run in CI (root). As root the command runs without that
capability: setpriv (util-linux) drops it from the bounding set, so the exec'd process never has
it; still root, it reads everything it did (CAP_DAC_READ_SEARCH stays)."""
from __future__ import annotations

import os
from typing import Sequence


def as_a_user(command: Sequence[str]) -> list[str]:
    if os.geteuid() == 0:
        return ["setpriv", "--bounding-set=-dac_override", "--", *command]
    return list(command)
