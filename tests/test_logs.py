"""Every line a role logs names its time, its role and its process (dorylus/logs.py): run in a
subprocess, as a role process configures its logging once for the whole process."""

from __future__ import annotations

import datetime
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LINE = re.compile(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3}) (\S+)\[(\d+)\] (DEBUG|INFO|WARNING|ERROR) (.*)")


def role_lines(role: str, level: str, body: str) -> tuple[subprocess.CompletedProcess, list[re.Match]]:
    code = (f"import logging, warnings\nfrom dorylus import logs\nlogs.setup({role!r}, {level!r})\n"
            "log = logging.getLogger('dorylus.somewhere')\n" + body)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0 and proc.stdout == "", proc.stderr
    lines = proc.stderr.splitlines()
    matches = [LINE.fullmatch(line) for line in lines]
    assert all(matches), lines
    return proc, matches


def test_each_line_names_time_role_pid_and_level():
    before = datetime.datetime.now()
    proc, lines = role_lines("graphserver-1", "INFO", "log.info('listening on %s', 'ipc:///x')\n"
                                                      "log.warning('refused a message')\n"
                                                      "log.debug('not at INFO')\n"
                                                      "warnings.warn('a library warns')\n")
    after = datetime.datetime.now()
    assert [(m[4], m[5]) for m in lines] == [("INFO", "listening on ipc:///x"), ("WARNING", "refused a message"),
                                             ("WARNING", "<string>:8: UserWarning: a library warns")]
    pids = {int(m[3]) for m in lines}
    assert {m[2] for m in lines} == {"graphserver-1"} and len(pids) == 1 and pids != {os.getpid()}
    for m in lines:  # local time, to the millisecond
        when = datetime.datetime.strptime(m[1], "%Y-%m-%d %H:%M:%S.%f")
        assert before - datetime.timedelta(seconds=1) <= when <= after


def test_the_level_option_silences_what_is_below_it():
    _, lines = role_lines("paramserver", "WARNING", "log.info('hidden')\nlog.error('failed')\n")
    assert [(m[2], m[4], m[5]) for m in lines] == [("paramserver", "ERROR", "failed")]
