"""The state file: a snapshot replaces the last one with no moment at which there is none."""

from __future__ import annotations

import json
import os

import pytest

from sdcwatch.service.statefile import previous_state, read_state, write_state


def test_the_state_file_is_never_missing_while_a_snapshot_replaces_it(tmp_path, monkeypatch):
    path = tmp_path / "pipeline-state.json"
    write_state(path, {"n": 1})
    seen = []
    replace = os.replace

    def watched(src, dst):  # every rename the writer makes: the state file must be there before it
        seen.append(path.is_file())
        replace(src, dst)

    monkeypatch.setattr(os, "replace", watched)
    write_state(path, {"n": 2})
    write_state(path, {"n": 3})
    assert seen and all(seen)
    assert read_state(path) == {"n": 3}
    assert json.loads(previous_state(path).read_text()) == {"n": 2}
    assert not list(tmp_path.glob("*.tmp"))


def test_a_snapshot_that_cannot_keep_the_previous_one_leaves_the_current_one_in_place(tmp_path, monkeypatch):
    path = tmp_path / "pipeline-state.json"
    write_state(path, {"n": 1})

    def no_room(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "link", no_room)
    monkeypatch.setattr("shutil.copy2", no_room)
    with pytest.raises(OSError):
        write_state(path, {"n": 2})
    assert read_state(path) == {"n": 1}
    assert not list(tmp_path.glob("*.tmp"))
