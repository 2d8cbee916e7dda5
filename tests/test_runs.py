"""The run directory's metrics file, read while it is written and after a kill mid-line."""

from __future__ import annotations

import json

import pytest

from dorylus.errors import ConfigError
from dorylus.runs import RunDir, read_metrics


def _lines(*epochs: int) -> str:
    return "".join(json.dumps({"epoch": e, "loss": 1.0 / e}) + "\n" for e in epochs)


def test_a_line_still_being_written_is_left_out(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(_lines(1, 2) + '{"epoch": 3, "loss": 0.3')
    assert [m["epoch"] for m in read_metrics(tmp_path)] == [1, 2]


def test_resume_drops_a_line_cut_by_a_kill_and_logs_after_the_checkpoint(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(_lines(1, 2, 3) + '{"epoch": 4, "lo')
    run = RunDir.reopen(tmp_path, {"epochs": 5}, last_epoch=2)
    run.log_epoch({"epoch": 3, "loss": 0.5})
    run.close()
    assert (tmp_path / "metrics.jsonl").read_text() == _lines(1, 2) + json.dumps({"epoch": 3, "loss": 0.5}) + "\n"


@pytest.mark.parametrize("bad", ['{"epoch": 2,, "loss": 1}', "[1, 2]"])
def test_a_corrupt_complete_line_is_an_error_naming_file_and_line(tmp_path, bad):
    (tmp_path / "metrics.jsonl").write_text(_lines(1) + bad + "\n" + _lines(3))
    with pytest.raises(ConfigError, match=r"metrics\.jsonl, line 2: not a JSON object"):
        read_metrics(tmp_path)
