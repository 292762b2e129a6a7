"""Logging of the two roles' processes (trainer ranks, rollout nodes): one set-up for both.

httpx logs every request at INFO ("HTTP Request: POST http://.../generate 200 OK"): the rollout
driver sends thousands per rollout, and in a demo's rollout-0.log 152 of 167 lines were those.
Its logger (and httpcore's, below it) stay at WARNING; failures still surface through our own
retry and error messages.
"""

from __future__ import annotations

import logging

QUIET_LOGGERS = ("httpx", "httpcore")


def configure(fmt: str) -> None:
    logging.basicConfig(level=logging.INFO, format=fmt)
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
