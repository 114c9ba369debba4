"""One page's bash, as a reader's terminal: the examples of README and docs/ run in it block by
block (tests/cluster/test_readme.py on the session's cluster; README's AWS steps in the
fake-cloud rehearsal, tests/fakecloud/test_ray_up.py), and how a block's run is judged."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import time
from pathlib import Path

TRACEBACK = "Traceback (most recent call last)"
# Ray 2.60's own background-thread noise, printed by a job whose work finished: Ray Data's
# file lister signals completion into a queue its executor already shut
# (ray/data/_internal/dynamic_work_queue.py, _signal_completion -> InterruptedError). Only
# that exact traceback is passed over; any other fails the block.
RAY_NOISE = re.compile(r"(?:^.*Traceback \(most recent call last\):\n)(?:.*\n){1,12}?"
                       r".*dynamic_work_queue\.py\", line \d+, in _signal_completion\n"
                       r"(?:.*\n){1,4}?.*\bInterruptedError\n", re.M)


class PageShell:
    """One page's bash: its blocks run in it one after another, each as `set -e -o pipefail`
    runs a script. A failing block ends the shell; the test fails there."""

    def __init__(self, page: str, work: Path, env: dict, logs: Path, wrap=None):
        """``wrap``: what the bash's argv runs under (e.g. the fake cloud's operator_command)."""
        self.page, self.logs, self.n = page, logs, 0
        argv = ["bash", "--noprofile", "--norc", "-e", "-o", "pipefail"]
        self.proc = subprocess.Popen(
            wrap(argv) if wrap else argv, cwd=work, env=env,
            stdin=subprocess.PIPE, stdout=open(logs / f"{_slug(page)}.shell.log", "w"),
            stderr=subprocess.STDOUT, text=True, start_new_session=True)

    def run(self, body: str, timeout: float) -> tuple[int, str]:
        """(exit status, output) of one block."""
        self.n += 1
        stem = self.logs / f"{_slug(self.page)}-{self.n}"
        script, out, rc = (stem.with_suffix(".sh"), stem.with_suffix(".out"),
                           stem.with_suffix(".rc"))
        script.write_text(body + "\n")
        q = shlex.quote
        # Its stdin is /dev/null: a command reading stdin must not eat the page's next block.
        self.proc.stdin.write(f"source {q(str(script))} > {q(str(out))} 2>&1 < /dev/null\n"
                              f"echo $? > {q(str(rc))}.new && mv {q(str(rc))}.new {q(str(rc))}\n")
        self.proc.stdin.flush()
        deadline = time.monotonic() + timeout
        while not rc.exists() and self.proc.poll() is None:
            if time.monotonic() > deadline:
                self.close()
                return 124, out.read_text() if out.exists() else ""
            time.sleep(0.2)
        status = int(rc.read_text()) if rc.exists() else self.proc.returncode
        return status, out.read_text() if out.exists() else ""

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def _slug(page: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", page)




def check_block(where: str, status: int, out: str, expects: list[str]) -> None:
    """A block passes when it exits 0, prints every expected regex and no traceback."""
    where = f"{where}: exit {status}\n{out[-4000:]}"
    assert status == 0, where
    for pattern in expects:
        assert re.search(pattern, out), f"{where}\nexpected: {pattern}"
    assert TRACEBACK not in RAY_NOISE.sub("", out), f"{where}\na traceback in its output"
