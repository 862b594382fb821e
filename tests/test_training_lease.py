"""One trainer per workspace: the training lease across real processes (held, waited for,
freed by ``kill -9``), the scheduler waiting for it, the slow loop refusing to train beside
another process and training on from the policy it published, and scheduler transitions that
say which process wrote them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from metaclaw import cli
from metaclaw.slowloop.scheduler.machine import Scheduler
from metaclaw.slowloop.scheduler.signals import SignalReading
from metaclaw.store import Store, this_process
from metaclaw.training_lease import TrainingBusy, TrainingLease
from waiting import wait_until

#: Holds the lease of the workspace database argv[1] until its standard input closes.
HOLDER = """
import sys
from metaclaw.store import Store
from metaclaw.training_lease import TrainingLease
lease = TrainingLease.for_store(Store(sys.argv[1]))
assert lease.acquire("a test's training run")
print("held", flush=True)
sys.stdin.read()
lease.release()
print("released", flush=True)
"""


@pytest.fixture
def holder(tmp_path):
    """Start another process holding the workspace's lease: returns (db path, process)."""
    db = tmp_path / "metaclaw.db"
    Store(db).close()
    started = []

    def start() -> subprocess.Popen:
        process = subprocess.Popen([sys.executable, "-c", HOLDER, str(db)], text=True,
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert process.stdout.readline().strip() == "held"
        started.append(process)
        return process

    yield db, start
    for process in started:
        if process.poll() is None:
            process.kill()
        process.wait(10)


class Idle:
    name = "idle"

    def reading(self) -> SignalReading:
        return SignalReading("idle", True, True, "a test's idle signal")

    def close(self) -> None:
        pass


def test_the_lease_is_exclusive_across_processes_and_freed_by_kill_9(holder):
    db, start = holder
    process = start()
    lease = TrainingLease.for_store(Store(db))
    assert not lease.acquire()
    named = f"pid {process.pid} on "
    assert lease.holder().startswith(named) and "a test's training run" in lease.holder()
    assert lease.training_elsewhere().startswith(named)
    with pytest.raises(TrainingBusy, match=f"pid {process.pid} on .* is training this workspace"):
        with lease.holding():
            pass

    process.send_signal(signal.SIGKILL)  # the OS frees the lease of a dead holder
    process.wait(10)
    # its name is still in the file: not believed (a database server frees the lock once it
    # sees the connection closed, moments later)
    wait_until(lambda: lease.training_elsewhere() is None, timeout=10, what="the lease freed")
    wait_until(lease.acquire, timeout=10, what="the lease taken")
    assert lease.acquire()  # re-entrant for its holder
    assert lease.holder().startswith("this process") and lease.training_elsewhere() is None
    other = TrainingLease.for_store(Store(db))  # another object of this process is excluded
    assert not other.acquire() and str(os.getpid()) in other.training_elsewhere()
    lease.release()
    assert not other.acquire()  # still held once
    lease.release()
    assert other.acquire()
    other.release()


def test_a_scheduler_waits_while_another_process_trains_then_trains(holder, tmp_path):
    db, start = holder
    process = start()
    store = Store(db)
    steps = []
    lease = TrainingLease.for_store(store)
    scheduler = Scheduler([Idle()], train_step=lambda: steps.append(1) or len(steps) < 3,
                          store=store, lease=lease)
    assert scheduler.tick() == "window_open"
    status = scheduler.status(last=0)
    assert status["waiting_for"].startswith(f"pid {process.pid} on ")
    assert "waiting for pid" in status["reason"] and not steps
    assert scheduler.tick() == "window_open"  # still held: still waiting, nothing trained

    process.stdin.close()  # the other process ends its run
    assert process.stdout.readline().strip() == "released"
    assert scheduler.tick() == "training"
    assert scheduler.wait_for_training(30) and len(steps) == 3
    assert not lease.held  # given back when the run ended
    assert scheduler.tick() == "waiting" and scheduler.status(last=0)["waiting_for"] is None
    rows = store.query("SELECT to_state, process FROM scheduler_transitions ORDER BY id")
    assert [r["to_state"] for r in rows] == ["window_open", "training", "waiting"]
    assert {r["process"] for r in rows} == {this_process()}
    scheduler.close()


def test_status_names_the_process_training_the_workspace(holder, capsys):
    db, start = holder
    process = start()
    Store(db).record_transition(from_state="window_open", to_state="training",
                                reason="starting at step 1", process="pid 1 on elsewhere")
    assert cli.main(["scheduler", "status", "--db", str(db)]) == 0
    out = capsys.readouterr().out
    assert f"training this workspace now: pid {process.pid} on " in out
    assert "[pid 1 on elsewhere] window_open -> training" in out


def test_a_scheduler_view_shows_its_own_process_only(tmp_path):
    from metaclaw.notebook.widgets import SchedulerView

    store = Store(tmp_path / "metaclaw.db")
    store.record_transition(from_state="waiting", to_state="window_open", reason="theirs",
                            process="pid 1 on elsewhere")
    scheduler = Scheduler([Idle()], store=store)
    scheduler.tick()
    assert [t["reason"] for t in SchedulerView(scheduler).transitions] == [
        scheduler.transitions[0].reason]
    everyone = SchedulerView(lambda: scheduler.status(), store=store).transitions
    assert [t["reason"] for t in everyone][0] == "theirs" and len(everyone) == 2


# -- the slow loop ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    import torch

    from metaclaw.offline.tinymodel import write_tiny_model

    torch.set_num_threads(1)
    return str(write_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0))


def _query_turns(store: Store, asks=("say yes", "please say yes", "answer yes")) -> None:
    """Query-set turns of generation 0, as the proxy records them."""
    from metaclaw import buffers

    for i, ask in enumerate(asks):
        store.record_turn(session_id=f"s{i}", request_messages=[{"role": "user", "content": ask}],
                          status="ok", response="no")
    buffers.refresh(store)


def _reward(prompt, text: str) -> float:
    words = text.split()
    return sum(w == "yes" for w in words) / max(len(words), 1) + 0.01 * (len(text) % 5)


def test_the_slow_loop_refuses_to_train_beside_another_process(holder, tiny_model):
    from metaclaw.slowloop.backends import make_backend
    from metaclaw.slowloop.grpo import GRPOConfig
    from metaclaw.slowloop.loop import SlowLoop

    db, start = holder
    process = start()
    store = Store(db)
    _query_turns(store)
    loop = SlowLoop(store, make_backend("local", tiny_model, lora_rank=8, seed=0),
                    config=GRPOConfig(groups_per_step=2, group_size=4, max_tokens=4),
                    judge=_reward)
    for train in (loop.train_now, loop.step):
        with pytest.raises(TrainingBusy, match=f"pid {process.pid} on "):
            train()
    assert store.query("SELECT COUNT(*) AS n FROM training_steps")[0]["n"] == 0
    process.stdin.close()
    process.wait(10)
    assert loop.train_now(steps=1).steps_done == 1
    loop.close()


def test_a_second_process_trains_on_from_the_policy_the_first_published(tmp_path, tiny_model):
    """Two slow loops on one workspace, created side by side (each its own backend and state
    folder, as two processes have): the one that trains second starts from the version the
    first published, so the versions form one lineage."""
    from metaclaw.slowloop.backends import make_backend
    from metaclaw.slowloop.grpo import GRPOConfig
    from metaclaw.slowloop.loop import SlowLoop

    config = GRPOConfig(groups_per_step=2, group_size=4, max_tokens=4, learning_rate=1e-2)
    store = Store(tmp_path / "metaclaw.db")
    _query_turns(store)
    loops = [SlowLoop(store, make_backend("local", tiny_model, lora_rank=8, seed=k),
                      config=config, judge=_reward, state_dir=tmp_path / f"state-{k}")
             for k in (0, 1)]
    first, second = loops
    assert first.train_now(steps=1).steps_done == 1

    record = second.step()
    # it loaded version 1's weights (the version is taken only with them) and sampled from it
    assert record["policy_version"] == 1 == record["metrics"]["published_version"] - 1
    rows = store.query("SELECT version, meta FROM policy_versions ORDER BY version")
    assert [(r["version"], r["meta"]["run_id"]) for r in rows] == [
        (1, first.trainer.run_id), (2, second.trainer.run_id)]
    for loop in loops:
        loop.close()


def test_a_version_published_while_a_trainer_starts_is_adopted_once_its_weights_are_saved(
        tmp_path, tiny_model):
    """A process publishes a version, then saves its weights and points the version at them: a
    trainer created between the two (another process starting) finds the version without
    weights, and adopts it at its next step, when the weights are there."""
    from metaclaw.slowloop.backends import make_backend
    from metaclaw.slowloop.grpo import GRPOConfig
    from metaclaw.slowloop.loop import SlowLoop

    config = GRPOConfig(groups_per_step=2, group_size=4, max_tokens=4, learning_rate=1e-2)
    store = Store(tmp_path / "metaclaw.db")
    _query_turns(store)
    first = SlowLoop(store, make_backend("local", tiny_model, lora_rank=8, seed=0),
                     config=config, judge=_reward, state_dir=tmp_path / "state-0")
    assert first.train_now(steps=1).steps_done == 1
    saved = store.query("SELECT checkpoint FROM policy_versions WHERE version = 1")[0]
    # the store as the publishing process leaves it between its publish and its save
    store.execute("UPDATE policy_versions SET checkpoint = NULL WHERE version = 1")
    second = SlowLoop(store, make_backend("local", tiny_model, lora_rank=8, seed=1),
                      config=config, judge=_reward, state_dir=tmp_path / "state-1")
    assert second.backend.policy_version == 0
    store.execute("UPDATE policy_versions SET checkpoint = ? WHERE version = 1",
                  (saved["checkpoint"],))

    record = second.step()
    assert record["policy_version"] == 1  # sampled from the weights the first one published
    assert record["metrics"]["published_version"] == 2
    for loop in (first, second):
        loop.close()


def test_a_forked_child_does_not_keep_the_lease_its_parent_gave_back(tmp_path):
    """A process forked while training (a multiprocessing pool of a notebook) inherits the
    lease's open file; the lease is its parent's and is freed when the parent gives it back."""
    db = tmp_path / "metaclaw.db"
    Store(db).close()
    lease = TrainingLease.for_store(Store(db))
    assert lease.acquire("parent's run")
    read, write = os.pipe()
    started, running = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child
        held = True
        try:
            os.close(write)
            held = lease.held
            os.write(running, b"1")
            os.read(read, 1)  # lives on until the parent has checked
        finally:
            os._exit(1 if held else 0)
    os.close(read)
    try:
        assert os.read(started, 1) == b"1"  # the child runs (as a pool's worker would)
        lease.release()
        other = TrainingLease.for_store(Store(db))
        assert other.acquire(), other.holder()  # free while the child lives
        other.release()
    finally:
        for fd in (write, started, running):
            os.close(fd)
        _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0  # the child did not think it held the lease


@pytest.mark.sqlite_only  # the lock file beside a SQLite database
@pytest.mark.parametrize("content", [
    '{"process": "x", "pid": 1099511627776, "host": "%(host)s"}',  # beyond the OS's pids
    '{"process": "x", "pid": 1}',                                  # no "since"
    '{"process": "x", "since": "yesterday", "doing": 7}',
    "[" * 100_000,                                                 # nested past recursion
    '{"process": "%(huge)s"}',
])
def test_a_hostile_lock_file_is_named_without_failing(holder, capsys, content):
    import socket

    db, start = holder
    process = start()
    lock = db.with_name(db.name + ".training.lock")
    lock.write_text(content % {"host": socket.gethostname(), "huge": "y" * 5_000_000})
    lease = TrainingLease.for_store(Store(db))
    assert not lease.acquire()
    assert len(lease.holder()) < 300
    with pytest.raises(TrainingBusy):
        with lease.holding():
            pass
    assert cli.main(["scheduler", "status", "--db", str(db)]) == 0
    assert len(capsys.readouterr().out) < 10_000
    process.stdin.close()
