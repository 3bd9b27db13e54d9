"""make sweep's wait on the DVC experiment queue (docs/study/wait_queue.sh, with queue_status.sh, which make study's
run.sh shares): one failing `dvc queue status` must not end the wait.

`dvc queue status` sometimes fails once and answers the next time (a JSON read inside DVC while a task writes its
info file). That cannot be provoked on demand from the real DVC, so the fault is injected: a stand-in `dvc` on PATH
answers from a script of replies, and records every call. Everything else (bash, the scripts) is what users run."""

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WAIT = ROOT / "docs" / "study" / "wait_queue.sh"

QUEUED = "Task     Name    Created    Status\nabc123   exp-1   10:00 PM   Running\nWorker status: 1 active, 0 idle"
DONE = "Task     Name    Created    Status\nabc123   exp-1   10:00 PM   Success\nWorker status: 0 active, 0 idle"
FAILED = "Task     Name    Created    Status\nabc123   exp-1   10:00 PM   Failed\nWorker status: 0 active, 0 idle"
FAIL = None  # this call of `dvc queue status` fails as DVC's does


def wait_with(tmp_path: Path, replies: list, **env) -> tuple[subprocess.CompletedProcess, list[str]]:
    """Run wait_queue.sh against a stand-in dvc that answers `queue status` with `replies` in turn (the last one
    again once they run out); return the result and the dvc calls it made."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for i, reply in enumerate(replies):
        (tmp_path / f"reply{i}").write_text("FAIL" if reply is FAIL else reply)
    (bin_dir / "dvc").write_text(f"""#!/usr/bin/env bash
echo "$*" >> {tmp_path}/calls
[ "$*" = "queue status" ] || exit 0
n=$(grep -c '^queue status$' {tmp_path}/calls)
f={tmp_path}/reply$((n - 1)); [ -e "$f" ] || f={tmp_path}/reply{len(replies) - 1}
if [ "$(cat "$f")" = FAIL ]; then echo "ERROR: unexpected error - Expecting value: line 1 column 1 (char 0)" >&2; exit 255; fi
cat "$f"
""")
    (bin_dir / "dvc").chmod(0o755)
    run_env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "QUEUE_POLL_S": "0",
               "QUEUE_STATUS_RETRY_S": "0", **env}
    result = subprocess.run(["bash", str(WAIT)], env=run_env, capture_output=True, text=True, timeout=60)
    return result, (tmp_path / "calls").read_text().splitlines()


def test_a_failing_status_is_asked_again_until_the_queue_has_ended(tmp_path):
    result, calls = wait_with(tmp_path, [QUEUED, FAIL, FAIL, QUEUED, FAIL, DONE])
    assert result.returncode == 0, result.stderr
    assert calls[0] == "queue start -j 1"
    assert calls.count("queue status") == 6  # it waited through all three failures, to the queue's Success
    assert "Success" in result.stdout
    assert result.stderr.count("Expecting value") == 3  # DVC's own message is shown, not hidden


def test_without_retries_the_same_replies_end_the_wait_early_and_say_so(tmp_path):
    """Negative control: with one try per poll, the first failure ends the wait, with exit 1 and a line that says
    why (the loop before the fix ended here with exit 0, as though the queue had ended)."""
    result, calls = wait_with(tmp_path, [QUEUED, FAIL, FAIL, QUEUED, FAIL, DONE], QUEUE_STATUS_TRIES="1")
    assert result.returncode == 1
    assert calls.count("queue status") == 2
    assert "dvc queue status failed 1 times in a row: not waiting for the queue" in result.stderr


def test_a_status_that_keeps_failing_ends_the_wait_after_ten_tries(tmp_path):
    result, calls = wait_with(tmp_path, [QUEUED, FAIL])
    assert result.returncode == 1
    assert calls.count("queue status") == 1 + 10
    assert "failed 10 times in a row" in result.stderr


def test_a_failed_experiment_fails_the_wait(tmp_path):
    result, _ = wait_with(tmp_path, [QUEUED, FAIL, FAILED])
    assert result.returncode == 1
    assert "some experiments failed: dvc queue logs <name>" in result.stderr
