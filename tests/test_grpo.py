"""GRPO: advantage math and masks by hand, a real learning curve on the tiny model, stale query
data never trained, zero-variance groups skipped, pause at a step boundary and resume."""

from __future__ import annotations

import errno
import json
import math
import os
from pathlib import Path

import pytest

from metaclaw.slowloop.backends import BackendError, Datum
from metaclaw.slowloop.grpo import (GRPOConfig, Prompt, Task, compute_advantages,
                                    prompts_from_query_set, prompts_from_tasks, select_query_turns,
                                    train_grpo)
from metaclaw.store import Store, StoreBusy
from waiting import kill_once_it_says


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    import torch

    from metaclaw.offline.tinymodel import write_tiny_model

    torch.set_num_threads(1)  # a tiny model runs fastest on one thread, more so on a busy box

    return str(write_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0))


@pytest.fixture
def backend(tiny_model):
    from metaclaw.slowloop.backends import make_backend

    return make_backend("local", tiny_model, lora_rank=8, seed=0)


def yes_fraction(text: str) -> float:
    """The toy verifiable reward: the fraction of reply words that are "yes"."""
    words = text.split()
    return sum(w == "yes" for w in words) / max(len(words), 1)


YES_TASKS = [Task(p, yes_fraction) for p in
             ["say yes", "please say yes", "answer yes", "what is the word ?"]]


# -- advantages and masks --------------------------------------------------------------------
def test_group_advantages_by_hand():
    rewards = [[1, 0, 0, 1], [2, 2, 2, 2], [0, 0, 0, 3]]
    adv, skipped = compute_advantages(rewards, "group")
    assert skipped == 1 and adv[1] is None
    assert adv[0] == pytest.approx([1, -1, -1, 1])
    std2 = math.sqrt((3 * 0.75 ** 2 + 2.25 ** 2) / 4)  # 1.299...
    assert adv[2] == pytest.approx([-0.75 / std2] * 3 + [2.25 / std2])
    assert adv[2] == pytest.approx([-0.57735, -0.57735, -0.57735, 1.73205], abs=1e-5)


def test_batch_and_none_advantages_by_hand():
    rewards = [[1, 0, 0, 1], [2, 2, 2, 2], [0, 0, 0, 3]]
    # batch std over the kept rewards 1,0,0,1,0,0,0,3: mean 0.625, variance 7.875 / 8
    batch_std = math.sqrt(7.875 / 8)
    adv, skipped = compute_advantages(rewards, "batch")
    assert skipped == 1
    assert adv[0] == pytest.approx([0.5 / batch_std, -0.5 / batch_std, -0.5 / batch_std,
                                    0.5 / batch_std])
    assert adv[2] == pytest.approx([-0.75 / batch_std] * 3 + [2.25 / batch_std])
    adv, _ = compute_advantages(rewards, "none")
    assert adv[0] == pytest.approx([0.5, -0.5, -0.5, 0.5])
    assert adv[2] == pytest.approx([-0.75, -0.75, -0.75, 2.25])
    with pytest.raises(ValueError, match="advantage mode"):
        compute_advantages(rewards, "bogus")


def test_datum_masks_prompt_and_keeps_sampled_tokens_and_logprobs():
    d = Datum.from_sample([10, 11, 12], [20, 21], [-0.5, -1.5], advantage=2.0)
    assert d.model_input == [10, 11, 12, 20]
    assert d.target_tokens == [11, 12, 20, 21]
    assert d.logprobs == [0.0, 0.0, -0.5, -1.5]
    assert d.advantages == [0.0, 0.0, 2.0, 2.0]
    assert d.mask == [0.0, 0.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="logprobs"):
        Datum.from_sample([1, 2], [3, 4], [-0.1], 1.0)


def test_config_errors_name_the_fix():
    with pytest.raises(ValueError, match="advantage_norm"):
        GRPOConfig(advantage_norm="per-token").check()
    with pytest.raises(ValueError, match="group_size"):
        GRPOConfig(group_size=1).check()
    with pytest.raises(ValueError, match="unknown loss"):
        GRPOConfig(loss_fn="dpo").check()
    for rate in (-1.0, 0.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="learning_rate must be a positive number"):
            GRPOConfig(learning_rate=rate).check()


# -- the loop on the tiny model --------------------------------------------------------------
def test_fixed_seed_run_increases_mean_reward(backend, tmp_path):
    """Measured curve (seed 0): about 0.0 for the first steps, above 0.9 after ~16 steps."""
    store = Store(tmp_path / "db.sqlite")
    published = []
    config = GRPOConfig(steps=20, groups_per_step=4, group_size=8, max_tokens=8,
                        learning_rate=1e-2, seed=0)
    result = train_grpo(backend, prompts_from_tasks(backend, YES_TASKS), config=config,
                        store=store, on_publish=lambda sampler, v: published.append(v))
    curve = [h["reward_mean"] for h in result.history]
    assert sum(curve[:3]) / 3 < 0.1
    assert sum(curve[-3:]) / 3 > 0.8, curve
    rows = store.frame("training_steps")
    assert rows.height == 20 and rows["run_id"].n_unique() == 1
    # Sampling logprobs equal the learner's logprobs on-policy: the exact sampled tokens and
    # their own logprobs were trained (a re-tokenized or padded batch would not match).
    trained = [h for h in result.history if h["loss"] is not None]
    assert trained and all(abs(h["metrics"]["kl_sample_train"]) < 1e-4 for h in trained)
    assert all(abs(h["metrics"]["ratio_mean"] - 1) < 1e-4 for h in trained)
    versions = store.frame("policy_versions")
    assert versions["version"].to_list() == published == list(range(1, len(published) + 1))
    assert result.policy_version == published[-1]
    # each step records the version that sampled its data
    assert [h["policy_version"] for h in result.history][:2] == [0, 1]


def test_zero_variance_groups_are_skipped_and_counted(backend, tmp_path):
    store = Store(tmp_path / "db.sqlite")
    tasks = [Task("say yes", lambda text: 1.0), Task("hello", lambda text: 0.0)]
    before = backend.sampler()
    result = train_grpo(backend, prompts_from_tasks(backend, tasks), store=store,
                        config=GRPOConfig(steps=2, groups_per_step=2, group_size=4, max_tokens=4))
    for h in result.history:
        assert h["groups"] == 2 and h["skipped_groups"] == 2
        assert h["loss"] is None and h["tokens"] == 0
    assert backend.sampler() is before and backend.policy_version == 0  # nothing trained
    assert store.frame("policy_versions").height == 0


def _query_turn(store, generation, buffer_set="query", state="live", text="say yes"):
    return store.record_turn(session_id="s1", request_messages=[{"role": "user", "content": text}],
                             status="ok", skill_generation=generation, buffer_set=buffer_set,
                             buffer_state=state)


def test_stale_query_data_is_never_trained(backend, tmp_path):
    store = Store(tmp_path / "db.sqlite")
    store.add_generation(snapshot={}, kind="init")
    stale = _query_turn(store, 0)                      # an older generation's query turn
    store.add_generation(snapshot={"a": 1}, kind="evolve", parent=0)
    live = _query_turn(store, 1)
    _query_turn(store, 1, state="purged")
    _query_turn(store, 1, buffer_set="support")
    assert [t["id"] for t in select_query_turns(store)] == [live]
    assert [t["id"] for t in select_query_turns(store, generation=0)] == [stale]

    judged_turns = []

    def judge(prompt: Prompt, text: str) -> float:
        judged_turns.append(prompt.turn_id)
        return yes_fraction(text) + (0.01 if len(text) % 2 else 0.0)

    def evolve_after_second_step(record):
        if record["step"] == 1:  # the fast loop adapts: generation 2, no query turns yet
            store.add_generation(snapshot={"a": 2}, kind="evolve", parent=1)

    result = train_grpo(backend, lambda: prompts_from_query_set(store, backend), store=store,
                        judge=judge, on_step=evolve_after_second_step,
                        config=GRPOConfig(steps=5, groups_per_step=2, group_size=4, max_tokens=4))
    assert set(judged_turns) == {live}
    assert result.steps_done == 2 and result.stopped and "no prompts" in result.reason
    assert [h["skill_generation"] for h in result.history] == [1, 1]


def test_a_query_turn_whose_request_is_unreadable_is_not_trained_on(backend, tmp_path, caplog):
    """A turn whose stored request is not valid JSON (written by another program, a damaged
    page) is left out of the prompts instead of failing every step, or training on a request
    that was not the one served."""
    store = Store(tmp_path / "db.sqlite")
    store.add_generation(snapshot={}, kind="init")
    good, bad = _query_turn(store, 0), _query_turn(store, 0, text="hello")
    with store.transaction():
        store.execute("UPDATE turns SET request_messages = '[{' WHERE id = ?", (bad,))
    assert [p.turn_id for p in prompts_from_query_set(store, backend)] == [good]
    assert f"query turn {bad} is not trained on" in caplog.text


def test_generation_change_during_a_step_drops_its_groups(backend, tmp_path):
    store = Store(tmp_path / "db.sqlite")
    store.add_generation(snapshot={}, kind="init")
    _query_turn(store, 0)
    _query_turn(store, 0, text="hello")

    def judge(prompt: Prompt, text: str) -> float:
        if store.latest_generation() == 0:  # the evolver lands while this step is judging
            store.add_generation(snapshot={"a": 1}, kind="evolve", parent=0)
        return float(len(text) % 3)

    result = train_grpo(backend, lambda: prompts_from_query_set(store, backend), store=store,
                        judge=judge,
                        config=GRPOConfig(steps=3, groups_per_step=2, group_size=4, max_tokens=6))
    assert len(result.history) == 1 and "no prompts" in result.reason
    h = result.history[0]
    assert h["metrics"]["stale_groups"] == 2 and h["skipped_groups"] == 2
    assert h["loss"] is None and h["tokens"] == 0
    assert store.frame("policy_versions").height == 0 and backend.policy_version == 0


class _EvolvesDuringTraining:
    """The backend, with an evolution landing while its gradient step runs: a new generation
    whose support set is every live failure of the old one (what the evolver consumes)."""

    def __init__(self, backend, store, fail: bool = False):
        self.backend, self.store, self.fail = backend, store, fail

    def __getattr__(self, name):
        return getattr(self.backend, name)

    def train_step(self, datums, loss_fn, learning_rate):
        from metaclaw import buffers

        generation = self.store.add_generation(snapshot={"b": 1}, kind="evolve", parent=0)
        live = [t["id"] for t in self.store.turns("buffer_state = 'live'")]
        self.moved = buffers.advance(self.store, generation, consumed=live)
        if self.fail:
            raise RuntimeError("the device went away")
        return self.backend.train_step(datums, loss_fn, learning_rate)


def test_an_evolution_landing_during_the_gradient_step_never_trains_support(backend, tmp_path):
    """The turns a step trains on are claimed before its gradient step: an evolution that lands
    meanwhile keeps them in the query set (purged with their generation), never support."""
    store = Store(tmp_path / "db.sqlite")
    store.add_generation(snapshot={}, kind="init")
    turns = [_query_turn(store, 0), _query_turn(store, 0, text="hello")]
    racing = _EvolvesDuringTraining(backend, store)
    result = train_grpo(racing, lambda: prompts_from_query_set(store, backend), store=store,
                        judge=lambda prompt, text: float(len(text) % 3),
                        config=GRPOConfig(steps=1, groups_per_step=2, group_size=4, max_tokens=6))
    trained = [t for t in turns if store.turn(t)["trained_steps"]]
    assert result.history[0]["loss"] is not None and trained
    assert racing.moved["consumed"] == 2 - len(trained)
    for turn_id in trained:
        assert (store.turn(turn_id)["buffer_set"], store.turn(turn_id)["buffer_state"]) == (
            "query", "purged")
    assert store.turns("buffer_set = 'support' AND trained_steps > 0") == []


def test_a_failed_gradient_step_releases_its_claim(backend, tmp_path):
    store = Store(tmp_path / "db.sqlite")
    store.add_generation(snapshot={}, kind="init")
    turn = _query_turn(store, 0)
    racing = _EvolvesDuringTraining(backend, store, fail=True)
    with pytest.raises(RuntimeError, match="went away"):
        train_grpo(racing, lambda: prompts_from_query_set(store, backend), store=store,
                   judge=lambda prompt, text: float(len(text) % 3),
                   config=GRPOConfig(steps=1, groups_per_step=1, group_size=4, max_tokens=6))
    assert store.turn(turn)["trained_steps"] == 0


def test_a_step_failing_before_its_gradient_step_releases_its_claim(backend, tmp_path,
                                                                   monkeypatch):
    import metaclaw.slowloop.grpo

    def bad_sample(*args, **kwargs):
        raise ValueError("a sample with one logprob too few")

    monkeypatch.setattr(metaclaw.slowloop.grpo.Datum, "from_sample", bad_sample)
    store = Store(tmp_path / "db.sqlite")
    store.add_generation(snapshot={}, kind="init")
    turn = _query_turn(store, 0)
    with pytest.raises(ValueError, match="logprob"):
        train_grpo(backend, lambda: prompts_from_query_set(store, backend), store=store,
                   judge=lambda prompt, text: float(len(text) % 3),
                   config=GRPOConfig(steps=1, groups_per_step=1, group_size=4, max_tokens=6))
    assert store.turn(turn)["trained_steps"] == 0


def test_train_grpo_on_a_workspace_holds_its_training_lease(backend, tmp_path):
    """Another trainer of the workspace (here a lease held beside it) makes train_grpo refuse,
    naming it, rather than train turns whose claims that trainer would take for a dead one's."""
    from metaclaw.training_lease import TrainingBusy, TrainingLease

    store = Store(tmp_path / "db.sqlite")
    store.add_generation(snapshot={}, kind="init")
    turn = _query_turn(store, 0)
    other = TrainingLease.for_store(store)
    assert other.acquire("idle-window training")
    try:
        with pytest.raises(TrainingBusy, match="idle-window training"):
            train_grpo(backend, lambda: prompts_from_query_set(store, backend), store=store,
                       judge=lambda prompt, text: 1.0,
                       config=GRPOConfig(steps=1, groups_per_step=1, group_size=2, max_tokens=2))
    finally:
        other.release()
    assert store.turn(turn)["trained_steps"] == 0


def test_query_prompts_without_reward_need_a_judge(backend, tmp_path):
    store = Store(tmp_path / "db.sqlite")
    _query_turn(store, 0)
    with pytest.raises(ValueError, match="judge="):
        train_grpo(backend, prompts_from_query_set(store, backend),
                   config=GRPOConfig(steps=1, group_size=2, max_tokens=2))


def test_pause_at_step_boundary_then_resume(tiny_model, tmp_path):
    from metaclaw.slowloop.backends import make_backend

    state_dir = tmp_path / "state"
    store = Store(tmp_path / "db.sqlite")
    config = GRPOConfig(steps=6, groups_per_step=2, group_size=8, max_tokens=8,
                        state_dir=str(state_dir), save_every=0)
    first = make_backend("local", tiny_model, lora_rank=8, seed=0)
    prompts = prompts_from_tasks(first, YES_TASKS)
    calls = []

    def should_stop() -> bool:  # the user comes back before the 4th step
        calls.append(1)
        return len(calls) > 3

    paused = train_grpo(first, prompts, config=config, store=store, should_stop=should_stop)
    assert paused.stopped and paused.reason == "paused" and paused.steps_done == 3
    saved = json.loads((state_dir / "latest.json").read_text())
    assert saved["step"] == 2 and saved["run_id"] == paused.run_id

    probe = prompts[0].tokens
    reference = first.sampler().sample(probe, n=2, max_tokens=6, seed=7)

    # steps recorded after the saved state (a process stopped between two saves): their
    # weights are gone, and they are trained again under their numbers, one row a step
    for lost in (3, 4):
        store.record_training_step(run_id=paused.run_id, step=lost, backend="local",
                                   policy_version=paused.policy_version, skill_generation=0)
    second = make_backend("local", tiny_model, lora_rank=8, seed=1)  # different LoRA init
    resumed = train_grpo(second, prompts, config=GRPOConfig(**{**config.__dict__, "steps": 1}),
                         store=store, should_stop=lambda: False,
                         on_step=lambda r: calls.append(("resumed-at", r["step"])))
    assert resumed.run_id == paused.run_id
    assert [h["step"] for h in resumed.history] == [3]
    [event] = store.events(kind="training_steps_lost")
    assert "steps 3-4 were recorded but not saved" in event["message"]
    assert resumed.history[0]["policy_version"] == paused.policy_version
    # the resumed backend sampled step 3 from exactly the paused weights
    restored = make_backend("local", tiny_model, lora_rank=8, seed=2)
    restored.load_state(saved["checkpoint"])
    again = restored.sampler().sample(probe, n=2, max_tokens=6, seed=7)
    assert [s.tokens for s in again] == [s.tokens for s in reference]
    assert sum((s.logprobs for s in again), []) == pytest.approx(
        sum((s.logprobs for s in reference), []), abs=1e-5)
    # a truncated record of the latest state: an error naming it, not a bare JSON error
    (state_dir / "latest.json").write_text(json.dumps(saved)[:40])
    with pytest.raises(ValueError, match="cannot resume from .*latest.json"):
        train_grpo(restored, prompts, config=config, store=store)
    steps = store.frame("training_steps")["step"].to_list()
    assert steps == [0, 1, 2, 3]


def test_the_reward_sees_special_tokens_the_policy_emits(backend):
    """A role header sampled before the answer must not read as a clean answer to the reward
    (the display decode hides it), and the final end-of-sequence token is not part of it."""
    tok = backend.tokenizer
    header, end = tok.convert_tokens_to_ids("<|user|>"), backend.eos_token_id
    word = backend.encode("yes")
    assert backend.decode([header, *word, end]) == backend.decode([*word, end])
    assert backend.reward_text([*word, end]) == backend.decode(word)
    assert "<|user|>" in backend.reward_text([header, *word, end])


def test_a_version_published_without_saved_weights_is_not_adopted(tiny_model, tmp_path):
    """A process killed while saving the weights of the version it just published leaves the
    version's row without a checkpoint: a restarted trainer keeps serving the weights it has,
    under their own number, rather than the base weights labelled as that version."""
    from metaclaw.slowloop.backends import make_backend
    from metaclaw.slowloop.grpo import GRPOTrainer

    store = Store(tmp_path / "db.sqlite")
    store.add_policy_version(backend="local", base_model=str(tiny_model), checkpoint=None)
    backend = make_backend("local", tiny_model, lora_rank=4, seed=0)
    trainer = GRPOTrainer(backend, [], config=GRPOConfig(steps=1), store=store)
    assert trainer.sync_with_store() == 0 and backend.policy_version == 0
    assert backend.sampler().policy_version == 0


# -- the claim on a step's turns: expiring until the step is recorded -------------------------
KILLED_IN_GRADIENT_STEP = """
import sys, time
from metaclaw.slowloop.backends import make_backend
from metaclaw.slowloop.grpo import GRPOConfig, GRPOTrainer, prompts_from_query_set
from metaclaw.store import Store

store = Store(sys.argv[1])
backend = make_backend("local", sys.argv[2], lora_rank=4, seed=0)
real_train_step = backend.train_step

def train_step(datums, loss_fn, learning_rate):
    result = real_train_step(datums, loss_fn, learning_rate)  # the real gradient step ran
    print("in the gradient step", flush=True)
    time.sleep(600)  # killed here, before train_step returns
    return result

backend.train_step = train_step
trainer = GRPOTrainer(backend, lambda: prompts_from_query_set(store, backend), store=store,
                      judge=lambda prompt, text: float(len(text) % 3),
                      config=GRPOConfig(steps=1, groups_per_step=2, group_size=4, max_tokens=6))
trainer.claim_lease_s = float(sys.argv[3])
trainer.step()
"""


def test_a_trainer_killed_in_its_gradient_step_leaves_its_turns_untrained(tiny_model, tmp_path):
    """kill -9 of a trainer inside its gradient step: while its claim lasts, an evolution keeps
    the turns in the query set (the step may still be running); once the claim has expired the
    turns count as untrained, as they are, and an evolution makes its failures support."""
    import subprocess
    import sys
    import time

    from metaclaw import buffers

    path = tmp_path / "db.sqlite"
    store = Store(path)
    store.add_generation(snapshot={}, kind="init")
    turns = [_query_turn(store, 0), _query_turn(store, 0, text="hello")]
    for turn_id in turns:
        store.update_turn(turn_id, reward=-1.0)  # judged failures: the next evolution's evidence
    lease = 3.0
    proc = subprocess.Popen([sys.executable, "-c", KILLED_IN_GRADIENT_STEP, str(path),
                             tiny_model, str(lease)], stdout=subprocess.PIPE, text=True)
    kill_once_it_says(proc, "in the gradient step")
    claims = {t: store.turn(t)["train_claim_until"] for t in turns}  # renewed until killed
    assert all(until is not None for until in claims.values())
    if time.time() < min(claims.values()):  # the claim still lasts: maybe training right now
        assert buffers.consumable(store, turns) == []
        assert all(buffers.is_trained(store.turn(t)) for t in turns)
    time.sleep(max(0.0, max(claims.values()) - time.time()) + 0.1)
    for turn_id in turns:
        row = store.turn(turn_id)
        assert row["trained_steps"] == 0 and not buffers.is_trained(row)
    assert store.frame("training_steps").height == 0
    generation = store.add_generation(snapshot={"b": 1}, kind="evolve", parent=0)
    assert buffers.advance(store, generation, consumed=turns) == {"consumed": 2, "purged": 0}
    for turn_id in turns:
        row = store.turn(turn_id)
        assert (row["buffer_set"], row["buffer_state"]) == ("support", "consumed")
        assert row["train_claim_by"] is None and row["train_claim_until"] is None


KILLED_BEFORE_RECORDING = """
import sys, time
from metaclaw.slowloop.backends import make_backend
from metaclaw.slowloop.grpo import GRPOConfig, GRPOTrainer, prompts_from_query_set
from metaclaw.store import Store

store = Store(sys.argv[1])
backend = make_backend("local", sys.argv[2], lora_rank=4, seed=0)

def add_policy_version(**fields):
    print("saved, recording", flush=True)
    time.sleep(600)  # killed here: the weights are saved, the version not yet recorded

store.add_policy_version = add_policy_version
trainer = GRPOTrainer(backend, lambda: prompts_from_query_set(store, backend), store=store,
                      judge=lambda prompt, text: float(len(text) % 3),
                      config=GRPOConfig(steps=1, groups_per_step=2, group_size=4, max_tokens=6,
                                        state_dir=sys.argv[3]))
trainer.claim_lease_s = 1.0
trainer.step()
"""


def test_a_trainer_killed_between_saving_and_recording_loses_no_weights(tiny_model, tmp_path,
                                                                        monkeypatch):
    """kill -9 after a step saved its weights but before it recorded their version: no version
    is left without weights, the turns are not counted as trained into lost weights, and the
    restarted trainer resumes the state before, under its own number, and records its next
    version with its weights."""
    import subprocess
    import sys
    import time

    from metaclaw.slowloop.backends import make_backend
    from metaclaw.slowloop.grpo import GRPOTrainer

    path, state_dir = tmp_path / "db.sqlite", tmp_path / "state"
    store = Store(path)
    store.add_generation(snapshot={}, kind="init")
    turns = [_query_turn(store, 0), _query_turn(store, 0, text="hello")]
    proc = subprocess.Popen([sys.executable, "-c", KILLED_BEFORE_RECORDING, str(path),
                             tiny_model, str(state_dir)], stdout=subprocess.PIPE, text=True)
    kill_once_it_says(proc, "saved, recording")
    assert store.query("SELECT version FROM policy_versions") == []
    time.sleep(max(0.0, max(store.turn(t)["train_claim_until"] for t in turns) - time.time())
               + 0.1)
    assert all(store.turn(t)["trained_steps"] == 0 for t in turns)  # to be trained again

    backend = make_backend("local", tiny_model, lora_rank=4, seed=0)
    monkeypatch.chdir(tmp_path)
    trainer = GRPOTrainer(backend, lambda: prompts_from_query_set(store, backend), store=store,
                          judge=lambda prompt, text: float(len(text) % 3),
                          config=GRPOConfig(steps=1, groups_per_step=2, group_size=4,
                                            max_tokens=6, state_dir="state"))  # relative
    # the state before (none here): no number the store never recorded, no weights under it
    assert trainer.start_step == 0 and backend.policy_version == 0
    assert not (state_dir / "latest.json").exists()
    assert trainer.step()["metrics"]["published_version"] == 1
    rows = store.query("SELECT version, checkpoint FROM policy_versions")
    assert [r["version"] for r in rows] == [1] and (Path(rows[0]["checkpoint"]) /
                                                    "metaclaw_state.json").is_file()
    # recorded whole: a process started in another folder loads these weights
    assert Path(rows[0]["checkpoint"]).is_absolute()
    assert json.loads((state_dir / "latest.json").read_text())["policy_version"] == 1


class _EvolvesAfterLeases(_EvolvesDuringTraining):
    """The backend, with a gradient step that outlasts several claim leases before an evolution
    lands in it."""

    def __init__(self, backend, store, wait_s: float):
        super().__init__(backend, store)
        self.wait_s = wait_s

    def train_step(self, datums, loss_fn, learning_rate):
        import time

        time.sleep(self.wait_s)
        return super().train_step(datums, loss_fn, learning_rate)


def test_a_long_gradient_step_keeps_its_claim_alive(backend, tmp_path):
    """A gradient step longer than one claim renews it: an evolution landing late in the step
    still finds the turns claimed (query, purged), and the recorded step counts on them."""
    from metaclaw.slowloop.grpo import GRPOTrainer

    store = Store(tmp_path / "db.sqlite")
    store.add_generation(snapshot={}, kind="init")
    turns = [_query_turn(store, 0), _query_turn(store, 0, text="hello")]
    slow = _EvolvesAfterLeases(backend, store, wait_s=3.0)
    trainer = GRPOTrainer(slow, lambda: prompts_from_query_set(store, backend), store=store,
                          judge=lambda prompt, text: float(len(text) % 3),
                          config=GRPOConfig(steps=1, groups_per_step=2, group_size=4,
                                            max_tokens=6))
    trainer.claim_lease_s = 1.2  # renewed every 0.4 s; the evolution lands after 3 s
    record = trainer.step()
    assert record["loss"] is not None and "claims_lost" not in record["metrics"]
    trained = [t for t in turns if store.turn(t)["trained_steps"] == 1]
    assert trained and slow.moved["consumed"] == 2 - len(trained)
    for turn_id in trained:
        row = store.turn(turn_id)
        assert (row["buffer_set"], row["buffer_state"]) == ("query", "purged")
        assert row["train_claim_by"] is None
    assert store.turns("buffer_set = 'support' AND trained_steps > 0") == []


def test_a_reward_that_is_not_a_finite_number_costs_its_group(backend, tmp_path):
    """A reward of NaN or inf (a 0/0 in a reward function, a judge answering "NaN") fails its
    group's reward call: it does not pass for a zero-variance group nor make the step's reward
    mean NaN or inf."""
    from metaclaw.slowloop.grpo import compute_rewards

    prompt = Prompt(tokens=[1], reward=None)
    assert compute_rewards([prompt, prompt, prompt], [["a", "bb"], ["a", "bb"], ["a", "bb"]],
                           lambda p, text: {"a": 1.0, "bb": 0.0}[text]) == [[1.0, 0.0]] * 3
    for bad in (float("nan"), float("inf"), float("-inf")):
        assert compute_rewards([prompt], [["a", "bb"]],
                               lambda p, text: bad if text == "a" else 1.0) == [None]

    store = Store(tmp_path / "db.sqlite")
    tasks = [Task("say yes", lambda text: float("nan") if len(text) % 2 else 1.0),
             Task("hello", lambda text: float(len(text) % 3))]
    result = train_grpo(backend, prompts_from_tasks(backend, tasks), store=store,
                        config=GRPOConfig(steps=1, groups_per_step=2, group_size=4,
                                          max_tokens=4))
    h = result.history[0]
    assert h["metrics"]["reward_failures"] == 1 and h["metrics"]["zero_variance"] == []
    assert math.isfinite(h["reward_mean"]) and math.isfinite(h["reward_std"])
    assert store.query("SELECT reward_mean FROM training_steps")[0]["reward_mean"] is not None


def test_a_published_versions_checkpoint_is_never_overwritten(tiny_model, tmp_path):
    """A run started afresh in the state folder of an earlier one (``resume=False``), and a
    second trainer saving into the same folder, write new directories: every published
    version's checkpoint keeps exactly the weights it was published with."""
    from metaclaw.slowloop.backends import make_backend
    from metaclaw.slowloop.backends.local import read_state
    from metaclaw.slowloop.grpo import GRPOTrainer

    store = Store(tmp_path / "db.sqlite")
    config = GRPOConfig(steps=1, groups_per_step=2, group_size=4, max_tokens=6,
                        state_dir=str(tmp_path / "state"), resume=False, save_every=1)
    trainers = []
    for seed in (0, 1, 2):
        backend = make_backend("local", tiny_model, lora_rank=4, seed=seed)
        tasks = [Task(p, lambda text: float(len(text) % 3)) for p in ("say yes", "hello")]
        trainers.append(GRPOTrainer(backend, prompts_from_tasks(backend, tasks),
                                    config=config, store=store))
    probe = trainers[0].backend.render_chat([{"role": "user", "content": "say yes"}])
    served = {}
    for trainer in trainers + trainers[:1]:  # three runs at their step 0, then one at step 1
        record = trainer.step()
        version = record["metrics"]["published_version"]
        served[version] = trainer.backend.sampler().sample(probe, 2, 6, 1.0, seed=5)
    rows = store.query("SELECT version, checkpoint FROM policy_versions ORDER BY version")
    assert [r["version"] for r in rows] == sorted(served) == [1, 2, 3, 4]
    assert len({r["checkpoint"] for r in rows}) == 4
    for row in rows:
        assert read_state(row["checkpoint"])["policy_version"] == row["version"]
        restored = make_backend("local", tiny_model, lora_rank=4, seed=9)
        restored.load_state(row["checkpoint"])
        again = restored.sampler().sample(probe, 2, 6, 1.0, seed=5)
        assert [s.tokens for s in again] == [s.tokens for s in served[row["version"]]]
    assert not list((tmp_path / "state").glob("latest.json.*"))  # no temporary file left


def test_a_version_whose_weights_cannot_be_loaded_here_is_not_adopted(tiny_model, tmp_path):
    """The store's newest version is adopted only with its weights: one of another backend or
    base model, or whose saved state is gone or broken, leaves the trainer serving its own
    weights under their own number (not the base weights labelled as that version)."""
    from metaclaw.offline.tinymodel import write_tiny_model
    from metaclaw.slowloop.backends import make_backend
    from metaclaw.slowloop.grpo import GRPOTrainer

    trained = make_backend("local", tiny_model, lora_rank=4, seed=3)
    trained.train_step([Datum.from_sample([1, 2], [3, 4], [-1.0, -1.0], 1.0)],
                       "importance_sampling", 0.05)
    trained.publish(1)
    good = trained.save_state(str(tmp_path / "good"))
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in (tmp_path / "good").iterdir():  # a copy of the good state, its adapter cut
        (broken / f.name).write_bytes(f.read_bytes())
    (broken / "adapter_model.safetensors").write_bytes(b"\x00" * 40)
    other = str(write_tiny_model(tmp_path / "other", seed=1))
    store = Store(tmp_path / "db.sqlite")
    cases = [dict(backend="tinker", base_model="Qwen/Qwen3-4B", checkpoint="tinker://r/w/1"),
             dict(backend="local", base_model=other, checkpoint=good),
             dict(backend="local", base_model=trained.base_model,
                  checkpoint=str(tmp_path / "deleted")),
             dict(backend="local", base_model=trained.base_model, checkpoint=str(broken))]
    backend = make_backend("local", tiny_model, lora_rank=4, seed=0)
    probe = backend.render_chat([{"role": "user", "content": "say yes"}])
    own = [s.tokens for s in backend.sampler().sample(probe, 2, 6, 1.0, seed=5)]
    for case in cases:
        store.add_policy_version(**case)
        trainer = GRPOTrainer(backend, [], config=GRPOConfig(steps=1), store=store)
        assert trainer.sync_with_store() == 0 == backend.policy_version, case
        assert backend.sampler().policy_version == 0
        assert [s.tokens for s in backend.sampler().sample(probe, 2, 6, 1.0, seed=5)] == own
    version = store.add_policy_version(backend="local", base_model=trained.base_model,
                                       checkpoint=good)
    GRPOTrainer(backend, [], config=GRPOConfig(steps=1), store=store)
    assert backend.policy_version == version == 5
    assert [s.tokens for s in backend.sampler().sample(probe, 2, 6, 1.0, seed=5)] == [
        s.tokens for s in trained.sampler().sample(probe, 2, 6, 1.0, seed=5)]


# -- durable checkpoints: synced to disk before a version points at them ---------------------
def _published_step_trainer(tiny_model, tmp_path, state_dir):
    """A trainer whose next step publishes a version and saves its state into ``state_dir``."""
    from metaclaw.slowloop.backends import make_backend
    from metaclaw.slowloop.grpo import GRPOTrainer

    store = Store(tmp_path / "db.sqlite")
    backend = make_backend("local", tiny_model, lora_rank=4, seed=0)
    config = GRPOConfig(steps=1, groups_per_step=2, group_size=4, max_tokens=6,
                        state_dir=str(state_dir), save_every=0)
    tasks = [Task(p, lambda text: float(len(text) % 3)) for p in ("say yes", "hello")]
    return GRPOTrainer(backend, prompts_from_tasks(backend, tasks), config=config,
                       store=store), store


def test_a_saved_state_is_synced_before_its_version_points_at_it(tiny_model, tmp_path,
                                                                  monkeypatch):
    """Every file of the saved state, its folder, the new ``latest.json`` (before it replaces
    the old one) and the state folder (after) are fsynced before the store records the
    version's checkpoint: after a power loss a recorded checkpoint is never truncated files."""
    state_dir = tmp_path / "state"
    trainer, store = _published_step_trainer(tiny_model, tmp_path, state_dir)
    events: list[tuple[str, object]] = []
    real_fsync, real_replace, real_add = os.fsync, os.replace, store.add_policy_version

    def identity(stat: os.stat_result) -> tuple[int, int]:
        return stat.st_dev, stat.st_ino

    def fsync(fd):
        events.append(("fsync", identity(os.fstat(fd))))
        real_fsync(fd)

    def replace(src, dst, **kw):
        events.append(("replace", identity(os.stat(src))))
        real_replace(src, dst, **kw)

    def add_policy_version(**fields):
        events.append(("record", fields["checkpoint"]))
        return real_add(**fields)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(store, "add_policy_version", add_policy_version)
    assert trainer.step()["metrics"]["published_version"] == 1

    checkpoint = store.query("SELECT checkpoint FROM policy_versions")[0]["checkpoint"]
    record = events.index(("record", checkpoint))
    synced = [key for kind, key in events[:record] if kind == "fsync"]
    state = [p for p in Path(checkpoint).rglob("*") if p.name != "metaclaw_state.json"] + [
        Path(checkpoint)]
    assert any(p.name == "adapter_model.safetensors" for p in state)
    assert {identity(p.stat()) for p in state} <= set(synced)  # files and folder, all synced
    # latest.json points at the state only once its version is recorded, under that number
    latest = identity((state_dir / "latest.json").stat())
    replaced = events.index(("replace", latest))
    assert record < replaced and ("fsync", latest) in events[record:replaced]  # its data first
    assert ("fsync", identity(state_dir.stat())) in events[replaced:]  # then the rename
    assert json.loads((state_dir / "latest.json").read_text())["checkpoint"] == checkpoint


def test_saved_weights_whose_number_another_writer_took_resume_under_their_recorded_one(
        tiny_model, tmp_path):
    """Another trainer records a version while this one saves: this one's weights are recorded
    as the next number, and ``latest.json`` says that number, so a resumed trainer does not
    serve them labelled as the other trainer's version."""
    from metaclaw.slowloop.backends import make_backend
    from metaclaw.slowloop.grpo import GRPOTrainer

    state_dir = tmp_path / "state"
    trainer, store = _published_step_trainer(tiny_model, tmp_path, state_dir)
    real_add = store.add_policy_version

    def add_policy_version(**fields):  # the other writer's version lands first
        real_add(backend="tinker", base_model="other", checkpoint="tinker://other")
        return real_add(**fields)

    store.add_policy_version = add_policy_version
    assert trainer.step()["metrics"]["published_version"] == 2
    latest = json.loads((state_dir / "latest.json").read_text())
    assert latest["policy_version"] == 2
    # the state itself says so too (what a resume falling back to it reads)
    assert json.loads((Path(latest["checkpoint"]) / "metaclaw_state.json").read_text())[
        "policy_version"] == 2
    resumed = make_backend("local", tiny_model, lora_rank=4, seed=0)
    GRPOTrainer(resumed, [], config=GRPOConfig(state_dir=str(state_dir)), store=store)
    assert resumed.policy_version == 2


def test_a_step_tried_again_after_its_version_could_not_be_recorded_saves_its_weights(
        tiny_model, tmp_path):
    """The store refused the record (busy, a dropped connection) and the scheduler ran the step
    again: it recorded its version without a checkpoint (the state counted as saved already)."""
    state_dir = tmp_path / "state"
    trainer, store = _published_step_trainer(tiny_model, tmp_path, state_dir)
    real_add, refusals = store.add_policy_version, [1]

    def add_policy_version(**fields):
        if refusals:
            refusals.pop()
            raise StoreBusy("another process holds the write lock")
        return real_add(**fields)

    store.add_policy_version = add_policy_version
    with pytest.raises(StoreBusy):
        trainer.step()
    assert not (state_dir / "latest.json").exists()  # the unrecorded state is not resumed
    assert trainer.step()["metrics"]["published_version"] == 1
    [row] = store.query("SELECT version, checkpoint FROM policy_versions")
    assert row["checkpoint"] and (Path(row["checkpoint"]) / "adapter_model.safetensors").is_file()
    latest = json.loads((state_dir / "latest.json").read_text())
    assert (latest["checkpoint"], latest["policy_version"]) == (row["checkpoint"], 1)


@pytest.mark.parametrize("failure", [
    "fsync fails", "under a file",
    pytest.param("read-only folder", marks=pytest.mark.skipif(
        not hasattr(os, "geteuid") or os.geteuid() == 0,
        reason="root writes into a read-only folder")),
])
def test_a_state_that_cannot_be_written_or_synced_is_never_recorded(tiny_model, tmp_path,
                                                                    monkeypatch, failure):
    """A failing fsync (e.g. EIO) or a folder that cannot be written is one clear error naming
    the folder, and no version is recorded: no process adopts weights that may not be on
    disk."""
    from metaclaw.slowloop.backends import make_backend
    from metaclaw.slowloop.grpo import GRPOTrainer

    state_dir = tmp_path / "state"
    if failure == "under a file":
        (tmp_path / "a-file").write_text("")
        state_dir = tmp_path / "a-file" / "state"
    trainer, store = _published_step_trainer(tiny_model, tmp_path, state_dir)
    if failure == "fsync fails":
        def fsync(fd):
            raise OSError(errno.EIO, "Input/output error")

        monkeypatch.setattr(os, "fsync", fsync)
    elif failure == "read-only folder":
        state_dir.mkdir()
        state_dir.chmod(0o500)
    try:
        with pytest.raises(OSError, match="cannot save the training state in .*state.*; make "
                                          "the folder writable"):
            trainer.step()
    finally:
        if failure == "read-only folder":
            state_dir.chmod(0o700)
    assert store.query("SELECT version FROM policy_versions") == []
    if state_dir.is_dir():
        assert not (state_dir / "latest.json").exists()
        assert not list(state_dir.glob("latest.json.*"))  # no temporary file left
    monkeypatch.undo()
    fresh = make_backend("local", tiny_model, lora_rank=4, seed=0)
    GRPOTrainer(fresh, [], store=store)
    assert fresh.policy_version == 0


def test_a_remote_state_is_recorded_without_local_files(tmp_path):
    """A Tinker state lives on the service: nothing is synced for it, its unused folder is
    removed, and ``latest.json`` (a local file) still points at it."""
    from metaclaw.slowloop.grpo import GRPOTrainer

    class RemoteStateBackend:
        policy_version = 0

        def save_state(self, path):
            return f"tinker://run/weights/{Path(path).name}"

    trainer = GRPOTrainer(RemoteStateBackend(), [],
                          config=GRPOConfig(state_dir=str(tmp_path / "state")))
    trainer.next_step = 1
    assert trainer.save() == "tinker://run/weights/step-000000"
    assert not list((tmp_path / "state").glob("step-*"))
    assert json.loads((tmp_path / "state" / "latest.json").read_text())["checkpoint"] == \
        "tinker://run/weights/step-000000"


def test_a_damaged_latest_state_resumes_from_the_newest_one_that_loads(tiny_model, tmp_path,
                                                                        caplog):
    """It stopped training for good ("restore it, or start afresh") though an older state was
    intact, and starting afresh threw the trained lineage away."""
    from metaclaw.slowloop.backends import make_backend

    state_dir = tmp_path / "state"
    config = GRPOConfig(steps=2, groups_per_step=1, group_size=4, max_tokens=4,
                        state_dir=str(state_dir), save_every=1)
    first = make_backend("local", tiny_model, lora_rank=8, seed=0)
    prompts = prompts_from_tasks(first, YES_TASKS)
    done = train_grpo(first, prompts, config=config)
    saved = json.loads((state_dir / "latest.json").read_text())
    assert saved["step"] == 1
    weights = Path(saved["checkpoint"]) / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # truncated, as by a full disk
    second = make_backend("local", tiny_model, lora_rank=8, seed=1)
    with caplog.at_level("WARNING"):
        resumed = train_grpo(second, prompts, config=GRPOConfig(**{**config.__dict__,
                                                                   "steps": 1}))
    assert resumed.run_id == done.run_id and [h["step"] for h in resumed.history] == [1]
    assert "resumed from the newest one that loads" in caplog.text and "step-000000" in caplog.text
    for path in state_dir.glob("step-*"):  # nothing loads: the error says what to do
        if (path / "adapter_model.safetensors").is_file():
            (path / "adapter_model.safetensors").write_bytes(b"")
    (state_dir / "latest.json").write_text(json.dumps(saved))
    with pytest.raises(BackendError, match="start afresh"):
        train_grpo(make_backend("local", tiny_model, lora_rank=8, seed=2), prompts,
                   config=config)


def test_a_state_of_another_base_model_is_not_continued(tiny_model, tmp_path):
    """Training another base model in the same state folder continued the first one's LoRA
    weights and optimizer under its run (silently where the shapes fit, a page of size
    mismatches where they did not)."""
    from metaclaw.offline.tinymodel import write_tiny_model
    from metaclaw.slowloop.backends import make_backend

    state_dir = tmp_path / "state"
    config = GRPOConfig(steps=1, groups_per_step=1, group_size=2, max_tokens=4,
                        state_dir=str(state_dir), save_every=1)
    first = make_backend("local", tiny_model, lora_rank=8, seed=0)
    train_grpo(first, prompts_from_tasks(first, YES_TASKS), config=config)
    assert json.loads((state_dir / "latest.json").read_text())["base_model"] == first.base_model
    other = make_backend("local", str(write_tiny_model(tmp_path / "other", seed=1)),
                         lora_rank=8, seed=0)
    with pytest.raises(ValueError, match="saved for base model .* a state folder of its own"):
        train_grpo(other, prompts_from_tasks(other, YES_TASKS), config=config)
    with pytest.raises(BackendError, match="was trained on"):
        other.load_state(json.loads((state_dir / "latest.json").read_text())["checkpoint"])
