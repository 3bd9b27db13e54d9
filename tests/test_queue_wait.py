"""make sweep's wait on the DVC experiment queue (docs/study/wait_queue.sh with queue_status.sh, which make study's
run.sh shares): it waits for the grid it queued, through a failing `dvc queue status`, past other grids' tasks and a
worker that stopped early.

`dvc queue status` sometimes fails once and answers the next time (a JSON read inside DVC while a task writes its
info file), and a worker sometimes stops after one task; neither can be provoked on demand from the real DVC, so the
faults are injected: a stand-in `dvc` on PATH answers from a script of replies and records every call. Everything
else (bash, the scripts) is what users run; tests/test_e2e_dvc.py runs the real queue."""

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WAIT = ROOT / "docs" / "study" / "wait_queue.sh"
GRID = ["-S", "seed=0,1"]
OLD = "70fffc2  afoul-gest  12:19 PM   Failed"  # another grid's task, failed hours ago: DVC still lists it


def status(*ours: str, workers: str = "1 active, 0 idle") -> str:
    """A `dvc queue status` text: this grid's two tasks in the given states, the old failed task, the workers."""
    rows = [f"a11aa11  dotal-sins  10:55 PM   {ours[0]}", f"b22bb22  piney-cham  10:55 PM   {ours[1]}"]
    return "\n".join(["Task     Name        Created    Status", *rows, OLD, "", f"Worker status: {workers}"])


RUNNING = status("Running", "Queued")
DONE = status("Success", "Success")
FAIL = None  # this call of `dvc queue status` fails as DVC's does


def wait_with(tmp_path: Path, replies: list, **env) -> tuple[subprocess.CompletedProcess, list[str]]:
    """Run wait_queue.sh on GRID against a stand-in dvc that queues two tasks and answers `queue status` with
    `replies` in turn (the last one again once they run out); return the result and the dvc calls it made."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for i, reply in enumerate(replies):
        (tmp_path / f"reply{i}").write_text("FAIL" if reply is FAIL else reply)
    (bin_dir / "dvc").write_text(f"""#!/usr/bin/env bash
echo "$*" >> {tmp_path}/calls
if [ "$1 $2" = "exp run" ]; then
  printf "Queueing with overrides '{{'params.yaml': ['seed=0']}}'.\\nQueued experiment 'dotal-sins' for future execution.\\n"
  printf "Queueing with overrides '{{'params.yaml': ['seed=1']}}'.\\nQueued experiment 'piney-cham' for future execution.\\n"
fi
[ "$*" = "queue status" ] || exit 0
n=$(grep -c '^queue status$' {tmp_path}/calls)
f={tmp_path}/reply$((n - 1)); [ -e "$f" ] || f={tmp_path}/reply{len(replies) - 1}
if [ "$(cat "$f")" = FAIL ]; then echo "ERROR: unexpected error - Expecting value: line 1 column 1 (char 0)" >&2; exit 255; fi
cat "$f"
""")
    (bin_dir / "dvc").chmod(0o755)
    run_env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "QUEUE_POLL_S": "0",
               "QUEUE_STATUS_RETRY_S": "0", **env}
    result = subprocess.run(["bash", str(WAIT), *GRID], env=run_env, capture_output=True, text=True, timeout=60)
    return result, (tmp_path / "calls").read_text().splitlines()


def test_a_failing_status_is_asked_again_until_the_grid_has_ended(tmp_path):
    result, calls = wait_with(tmp_path, [RUNNING, FAIL, FAIL, RUNNING, FAIL, DONE])
    assert result.returncode == 0, result.stderr
    assert calls[:2] == ["exp run --queue -S seed=0,1", "queue start -j 1"]
    assert calls.count("queue status") == 6  # it waited through all three failures, to the grid's Success
    assert result.stderr.count("Expecting value") == 3  # DVC's own message is shown, not hidden


def test_without_retries_the_same_replies_end_the_wait_early_and_say_so(tmp_path):
    """Negative control: with one try per poll, the first failure ends the wait, with exit 1 and a line that says
    why (the loop before the fix ended here with exit 0, as though the queue had ended)."""
    result, calls = wait_with(tmp_path, [RUNNING, FAIL, FAIL, RUNNING, FAIL, DONE], QUEUE_STATUS_TRIES="1")
    assert result.returncode == 1
    assert calls.count("queue status") == 2
    assert "dvc queue status failed 1 times in a row: not waiting for the queue" in result.stderr


def test_a_status_that_keeps_failing_ends_the_wait_after_ten_tries(tmp_path):
    result, calls = wait_with(tmp_path, [RUNNING, FAIL])
    assert result.returncode == 1
    assert calls.count("queue status") == 1 + 10
    assert "failed 10 times in a row" in result.stderr


def test_only_this_grids_tasks_decide(tmp_path):
    """The old failed task fails nothing, and another grid's running task is not waited for; one of this grid's
    failing fails the sweep, with the line that says where to look."""
    other_running = DONE.replace(OLD, "c33cc33  gouty-stew  11:02 PM   Running")
    result, calls = wait_with(tmp_path, [RUNNING, other_running])
    assert result.returncode == 0, result.stderr
    assert calls.count("queue status") == 2
    assert "afoul-gest" not in result.stdout and "gouty-stew" not in result.stdout

    (tmp_path / "again").mkdir()
    result, _ = wait_with(tmp_path / "again", [RUNNING, status("Success", "Failed")])
    assert result.returncode == 1
    assert "some experiments failed: dvc queue logs <name>" in result.stderr


def test_a_stopped_worker_is_started_again_after_two_idle_polls(tmp_path):
    idle = status("Success", "Queued", workers="0 active, 0 idle")
    result, calls = wait_with(tmp_path, [RUNNING, idle, idle, RUNNING, DONE])
    assert result.returncode == 0, result.stderr
    assert calls.count("queue start -j 1") == 2  # once at the start, once after the second idle poll, not the first
    assert calls.index("queue start -j 1", 2) > [i for i, c in enumerate(calls) if c == "queue status"][2]


def test_a_task_the_queue_does_not_list_stops_the_wait(tmp_path):
    lost = "\n".join(line for line in RUNNING.splitlines() if "piney-cham" not in line)
    result, _ = wait_with(tmp_path, [lost])
    assert result.returncode == 1
    assert "does not list every task just queued (dotal-sins piney-cham)" in result.stderr


def test_the_grids_experiment_names_are_written_for_compare(tmp_path):
    """EXPS_FILE gets this grid's names only (not the old task's), which make sweep passes to compare --dvc-exp."""
    names = tmp_path / "sweep.exps"
    result, _ = wait_with(tmp_path, [RUNNING, DONE], EXPS_FILE=str(names))
    assert result.returncode == 0, result.stderr
    assert names.read_text().split() == ["dotal-sins", "piney-cham"]
