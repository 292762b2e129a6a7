"""--colocate under faults on the CPU stack (issue 31 item 5): an engine killed inside the trainer's turn
restarts after it; a TERM inside a later turn saves there, engines released, and acknowledges. The
scenario and what it asserts: tests/helpers/colocate_faults.py (the GPU tier runs the same one)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.colocate_faults import kill_then_term_inside_turns

pytestmark = [pytest.mark.sglang, pytest.mark.megatron, pytest.mark.slow]


def test_engine_killed_in_a_turn_restarts_after_it_and_a_term_in_a_turn_saves_there(tmp_path: Path) -> None:
    kill_then_term_inside_turns(tmp_path, [], steps=48, engines=2)  # ~10 s turns here
