"""Ready marks (storage/files.py): a process marks itself ready with its pid and takes the mark away when it
stops cleanly, so that a mark whose process is gone is one that did not stop cleanly."""

from __future__ import annotations

import json
import os

import pytest

from storage.files import clear_ready, mark_ready, ready_pid

pytestmark = pytest.mark.unit


def test_a_clean_stop_takes_the_processs_own_mark_away(tmp_path):
    mark_ready(tmp_path, "learner")
    assert ready_pid(tmp_path, "learner") == os.getpid()
    assert clear_ready(tmp_path, "learner") is True
    assert ready_pid(tmp_path, "learner") is None and list((tmp_path / "ready").iterdir()) == []
    assert clear_ready(tmp_path, "learner") is False  # nothing left: a second stop is no error


def test_a_mark_another_process_wrote_since_is_left_alone(tmp_path):
    """A restart that is ready already: the old process's late clean stop must not unmark it."""
    mark = tmp_path / "ready" / "ingest.json"
    mark.parent.mkdir()
    mark.write_text(json.dumps({"pid": os.getpid() + 1, "at": 0}))
    assert clear_ready(tmp_path, "ingest") is False
    assert ready_pid(tmp_path, "ingest") == os.getpid() + 1


def test_clearing_with_no_ready_directory_is_no_error(tmp_path):
    assert clear_ready(tmp_path / "state", "compactor") is False
