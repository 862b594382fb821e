"""The slow loop's invariants with several processes on one workspace: a proxy recording turns,
another process committing skill generations (a rollback), a trainer killed mid-step and the one
started after it, and a judge whose evidence arrives after a turn was first trained on."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from metaclaw import buffers
from metaclaw.slowloop.grpo import GRPOConfig
from metaclaw.slowloop.loop import SlowLoop
from metaclaw.store import Store
from test_slowloop import CONFIG, World
from waiting import kill_once_it_says

def REWARD(prompt, text: str) -> float:
    """A programmatic reward that varies within a group of the untrained tiny model."""
    return float(len(text) % 3)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    import torch

    from metaclaw.offline.tinymodel import write_tiny_model

    torch.set_num_threads(1)
    return str(write_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0))


@pytest.fixture
def world(tmp_path, tiny_model):
    w = World(tmp_path, tiny_model)
    yield w
    w.close()


def _ask(world, text: str, session: str, history=()):
    world.client.chat.completions.create(
        model="tiny", messages=[*history, {"role": "user", "content": text}], max_tokens=4,
        extra_headers={"X-Session-Id": session})
    world.proxy.flush()


def test_turns_the_proxy_records_train_without_a_fast_loop(world):
    """`metaclaw serve` without --auto-evolve: a served turn enters the query set as it is
    recorded, and a rollback committed by another process (`metaclaw skills rollback`) purges
    the query turns of the generation it replaced instead of training them."""
    loop = SlowLoop(world.store, world.backend, config=CONFIG, judge=REWARD, proxy=world.proxy)
    _ask(world, "say yes", "a")
    old = world.store.turns()[-1]["id"]
    assert (world.store.turn(old)["buffer_set"], world.store.turn(old)["buffer_state"]) == (
        "query", "live")  # classified as it was recorded, with no fast loop
    cli = [sys.executable, "-m", "metaclaw", "skills", "rollback", "0",
           "--db", str(world.root / "metaclaw.db"), "--skills", str(world.root / "skills")]
    world.library.remove("say-yes")  # generation 1, then another process restores generation 0
    subprocess.run(cli, check=True, capture_output=True, timeout=60)
    assert world.store.latest_generation() == 2
    _ask(world, "please say yes", "b")
    new = world.store.turns()[-1]["id"]
    assert world.store.turn(new)["skill_generation"] == 2
    record = loop.step()
    assert record is not False and record["skill_generation"] == 2 and record["groups"] == 1
    assert world.store.turn(old)["buffer_state"] == "purged"
    assert world.store.turn(old)["trained_steps"] == 0
    assert (world.store.turn(new)["buffer_set"], world.store.turn(new)["buffer_state"]) == (
        "query", "live")
    loop.close()


def test_the_judge_sees_a_consequence_recorded_after_the_turn_first_trained(world):
    """A query turn is trained on at every step; the user's next message recorded between two
    steps reaches the PRM judge at the second."""
    from metaclaw.fastloop.judge import Judge, parse_judge_prompt
    from metaclaw.offline.double import DoubleServer, Reply

    judged = []

    def verdict(body):
        judged.append(parse_judge_prompt(body["messages"][-1]["content"]))
        return Reply(content=json.dumps({"score": 1, "rationale": "scripted"}))

    with DoubleServer(verdict) as double:
        judge = Judge(double.url, "judge-double", votes=1, structured=False, timeout=10)
        loop = SlowLoop(world.store, world.backend, config=CONFIG, judge=judge,
                        proxy=world.proxy)
        _ask(world, "say yes", "s")
        buffers.refresh(world.store)  # classified here: this test is about the evidence only
        loop.step()
        assert judged and not any("wrong" in v for j in judged for v in j.values())
        _ask(world, "no, that is wrong", "s",
             history=[{"role": "user", "content": "say yes"},
                      {"role": "assistant", "content": "maybe"}])
        before = len(judged)
        loop.step()
        first = [j for j in judged[before:] if j["Task (user messages)"].strip() == "[1] say yes"]
        assert first and all(any("no, that is wrong" in v for v in j.values()) for j in first)
        loop.close()


KILLED_MID_STEP = """
import sys, time
from metaclaw.slowloop.backends import make_backend
from metaclaw.slowloop.grpo import GRPOConfig, GRPOTrainer, prompts_from_query_set
from metaclaw.store import Store
from metaclaw.training_lease import TrainingLease

store = Store(sys.argv[1])
backend = make_backend("local", sys.argv[2], lora_rank=4, seed=0)
real_train_step = backend.train_step

def train_step(datums, loss_fn, learning_rate):
    result = real_train_step(datums, loss_fn, learning_rate)
    print("in the gradient step", flush=True)
    time.sleep(600)  # killed here
    return result

backend.train_step = train_step
trainer = GRPOTrainer(backend, lambda: prompts_from_query_set(store, backend), store=store,
                      judge=lambda prompt, text: float(len(text) % 3),
                      config=GRPOConfig(steps=1, groups_per_step=2, group_size=4, max_tokens=6))
with TrainingLease.for_store(store).holding():
    trainer.step()
"""


def test_the_trainer_after_one_killed_mid_step_trains_its_turns_at_once(tmp_path, tiny_model):
    """kill -9 of a trainer in its gradient step leaves claims that last two minutes. The next
    trainer takes the workspace's lease, so no other step can be running: it drops them and
    trains the turns in its first step, instead of spending its steps on nothing."""
    from metaclaw.slowloop.backends import make_backend

    path = tmp_path / "metaclaw.db"
    store = Store(path)
    store.add_generation(snapshot={}, kind="init")
    turns = [store.record_turn(session_id="s", status="ok",
                               request_messages=[{"role": "user", "content": text}],
                               buffer_set="query", buffer_state="live")
             for text in ("say yes", "hello")]
    proc = subprocess.Popen([sys.executable, "-c", KILLED_MID_STEP, str(path), tiny_model],
                            stdout=subprocess.PIPE, text=True)
    kill_once_it_says(proc, "in the gradient step")
    assert all(store.turn(t)["train_claim_until"] > time.time() + 60 for t in turns)

    loop = SlowLoop(store, make_backend("local", tiny_model, lora_rank=4, seed=0),
                    config=GRPOConfig(groups_per_step=2, group_size=4, max_tokens=6,
                                      save_every=0), judge=REWARD, serve=False)
    result = loop.train_now(steps=2)
    assert result.steps_done == 2
    assert all(h["metrics"]["stale_groups"] == 0 and h["tokens"] > 0 for h in result.history)
    for turn_id in turns:
        row = store.turn(turn_id)
        assert row["trained_steps"] == 2 and row["train_claim_by"] is None
    assert store.events(kind="training_claims_released")[0]["detail"]["turns"] == 2
    loop.close()
    store.close()
