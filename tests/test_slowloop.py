"""The slow loop end to end, offline: turns served through the real proxy by the tiny model's
policy -> query set -> GRPO -> a new policy version hot-swapped into the proxy; stale query data
never trained; training gated by the idle scheduler (fake clock, injected keyboard signal) with
pause at a step boundary and resume; 50 concurrent proxied requests during publishes."""

from __future__ import annotations

import asyncio
import functools
import json
import threading
import time
from datetime import datetime, timezone

import httpx
import openai
import pytest

from metaclaw import buffers
from metaclaw.proxy.app import Proxy, ProxyConfig
from metaclaw.skills.library import Skill, SkillLibrary
from metaclaw.slowloop.grpo import GRPOConfig, Prompt, select_query_turns
from metaclaw.slowloop.loop import JudgeReward, SlowLoop, as_reward
from metaclaw.store import Store
import waiting

CONFIG = GRPOConfig(groups_per_step=2, group_size=4, max_tokens=6, learning_rate=1e-2,
                    save_every=0)
ASKS = ["say yes", "please say yes", "answer yes"]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    import torch

    from metaclaw.offline.tinymodel import write_tiny_model

    torch.set_num_threads(1)  # a tiny model runs fastest on one thread, more so on a busy box
    return str(write_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0))


class World:
    """A workspace: store, skill library, the proxy (no upstream) and a local backend."""

    def __init__(self, root, tiny_model):
        from metaclaw.slowloop.backends import make_backend

        self.root = root
        self.store = Store(root / "metaclaw.db")
        skill = Skill("say-yes", "Say yes when asked to say yes.", "general", "Answer: yes")
        (root / "skills" / skill.name).mkdir(parents=True)
        (root / "skills" / skill.name / "SKILL.md").write_text(skill.to_markdown())
        self.library = SkillLibrary(root / "skills", self.store)
        self.proxy = Proxy(ProxyConfig(retrieval="lexical"), self.store, self.library).start()
        self.backend = make_backend("local", tiny_model, lora_rank=8, seed=0)
        self.client = openai.OpenAI(base_url=self.proxy.url, api_key="unused", max_retries=0)
        self.judged: list[int | None] = []

    def reward(self, prompt: Prompt, text: str) -> float:
        """Programmatic reward: fraction of "yes" words, plus a small length term so a group of
        the untrained model rarely has zero variance."""
        self.judged.append(prompt.turn_id)
        words = text.split()
        return sum(w == "yes" for w in words) / max(len(words), 1) + 0.01 * (len(text) % 5)

    def ask(self, text: str, **params):
        return self.client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": text}],
            **{"max_tokens": 6, **params})

    def serve_query_turns(self, asks=ASKS) -> list[int]:
        """Serve one request per ask through the proxy, then classify the turns (query set)."""
        for text in asks:
            self.ask(text)
        self.proxy.flush()
        buffers.refresh(self.store)
        return [t["id"] for t in select_query_turns(self.store)]

    def close(self):
        self.client.close()
        self.proxy.stop()
        self.store.close()


@pytest.fixture
def world(tmp_path, tiny_model):
    w = World(tmp_path, tiny_model)
    yield w
    w.close()


wait_until = functools.partial(waiting.wait_until, timeout=30.0, interval=0.01)


# -- serve -> train -> serve the new version ------------------------------------------------
def test_turns_train_and_the_proxy_serves_the_new_version(world):
    loop = SlowLoop(world.store, world.backend, config=CONFIG, judge=world.reward,
                    proxy=world.proxy, state_dir=world.root / "state")
    assert world.proxy.responder is loop.responder and loop.responder.policy_version == 0

    query_ids = world.serve_query_turns()
    assert len(query_ids) == 3
    for turn in world.store.turns():
        assert turn["policy_version"] == 0 and turn["injected_skills"] == ["say-yes"]
        assert turn["prompt_tokens_ids"] == world.backend.render_chat(turn["request_messages"])
        assert turn["completion_tokens_ids"] and all(lp <= 0 for lp in turn["completion_logprobs"])
        assert len(turn["completion_logprobs"]) == len(turn["completion_tokens_ids"])

    seen = []
    result = loop.train_now(steps=2, on_step=seen.append)
    assert (result.steps_done, result.stopped, result.policy_version) == (2, False, 2)
    assert [r["step"] for r in seen] == [0, 1] and [r["policy_version"] for r in seen] == [0, 1]
    assert set(world.judged) <= set(query_ids) and len(set(world.judged)) >= 2
    assert loop.responder.policy_version == 2 == world.proxy.policy_version
    assert world.store.frame("policy_versions")["version"].to_list() == [1, 2]
    assert json.loads((world.root / "state" / "latest.json").read_text())["step"] == 1

    # A new request through the proxy is answered by version 2: exactly what version 2's weights
    # sample for the recorded prompt tokens and seed; the metaclaw key never reaches the client.
    raw = world.client.chat.completions.with_raw_response.create(
        model="tiny", messages=[{"role": "user", "content": "say yes"}], max_tokens=6, seed=11,
        temperature=1.0)
    assert raw.headers["X-MetaClaw-Policy-Version"] == "2"
    assert "metaclaw" not in raw.http_response.json()
    reply = raw.parse()
    world.proxy.flush()
    turn = world.store.turns()[-1]
    assert turn["policy_version"] == 2 and turn["response"] == reply.choices[0].message.content
    assert turn["prompt_tokens_ids"] == world.backend.render_chat(turn["request_messages"])
    expected = world.backend.sampler().sample(turn["prompt_tokens_ids"], 1, 6, 1.0, 11)[0]
    assert turn["completion_tokens_ids"] == expected.tokens
    assert turn["completion_logprobs"] == pytest.approx(expected.logprobs, abs=1e-5)

    # Streaming: the same, with the metaclaw object held back from the SSE events.
    with httpx.stream("POST", world.proxy.url + "/chat/completions", json={
            "model": "tiny", "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 6, "stream": True}, timeout=30) as response:
        sse = "".join(response.iter_text())
    assert response.status_code == 200 and "data: [DONE]" in sse and "metaclaw" not in sse
    world.proxy.flush()
    turn = world.store.turns()[-1]
    assert turn["stream"] == 1 and turn["policy_version"] == 2
    assert len(turn["completion_tokens_ids"]) == len(turn["completion_logprobs"]) >= 1

    # A request the policy cannot serve is an OpenAI 400, streaming or not.
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError, match="n=1"):
            world.ask("say yes", n=2, stream=stream)
    status = loop.status()
    assert status["policy_version"] == status["serving_version"] == 2
    # the three trained turns and the two served since by version 2 (in the query set as they
    # were recorded); the two refused requests never enter it
    assert status["steps_done"] == 2 and status["query_turns"] == 5
    assert "Slow loop" in loop._repr_html_()
    loop.close()
    assert world.proxy.responder is None


def test_stale_query_data_is_never_trained(world):
    loop = SlowLoop(world.store, world.backend, config=CONFIG, judge=world.reward,
                    proxy=world.proxy)
    old_ids = world.serve_query_turns(ASKS[:2])
    assert len(old_ids) == 2
    # the fast loop adapts: a new skill generation; the old query turns are stale
    generation = world.library.add(Skill("greet", "Greet back politely.", "general", "hi"))
    assert loop.step() is False  # no live query turn of the current generation
    assert "no prompts" in loop.status()["nothing_to_train"]
    result = loop.train_now(steps=3)
    assert result.steps_done == 0 and result.stopped and "no prompts" in result.reason
    buffers.advance(world.store, generation)
    assert {t["buffer_state"] for t in world.store.turns()} == {"purged"}
    assert world.judged == [] and world.store.frame("training_steps").height == 0

    new_ids = world.serve_query_turns(["please say yes"])
    assert len(new_ids) == 1 and not set(new_ids) & set(old_ids)
    record = loop.step()
    assert record["skill_generation"] == generation and set(world.judged) == set(new_ids)
    loop.close()


def test_the_prm_judge_rewards_completions_as_turns(world):
    """The real Judge, voting through the offline OpenAI-compatible double (scripted verdicts:
    +1 when the judged reply says "yes", else -1), as the slow loop's reward."""
    from metaclaw.fastloop.judge import Judge, parse_judge_prompt
    from metaclaw.offline.double import DoubleServer, Reply
    from metaclaw.slowloop.grpo import compute_rewards

    judged = []

    def verdict(body):
        sections = parse_judge_prompt(body["messages"][-1]["content"])
        judged.append(sections)
        score = 1 if "yes" in sections["Reply"].split() else -1
        return Reply(content=json.dumps({"score": score, "rationale": "scripted"}))

    with DoubleServer(verdict) as double:
        judge = Judge(double.url, "judge-double", votes=1, structured=False, timeout=10)
        reward = as_reward(judge)
        assert isinstance(reward, JudgeReward)
        prompt = Prompt([1, 2], messages=[{"role": "user", "content": "weather in oslo?"}])
        call = '<tool_call>{"name": "weather", "arguments": {"city": "Oslo"}}</tool_call>'
        assert compute_rewards([prompt], [["yes " + call, "no"]], reward) == [[1.0, -1.0]]
        with_call = next(j for j in judged if "yes" in j["Reply"].split())
        assert "weather in oslo?" in with_call["Task (user messages)"]
        assert "Oslo" in with_call["Tool calls and tool results"]  # the tool call parsed out
        assert "tool_call" not in with_call["Reply"]

        loop = SlowLoop(world.store, world.backend, config=CONFIG, judge=judge,
                        proxy=world.proxy)
        query_ids = world.serve_query_turns(ASKS[:2])
        before = len(judged)
        record = loop.step()
        assert len(judged) - before == 2 * 4  # P x G completions judged, one vote each
        assert record["metrics"]["reward_failures"] == 0 and -1 <= record["reward_mean"] <= 1
        tasks = {j["Task (user messages)"].strip() for j in judged[before:]}
        assert tasks == {f"[1] {ask}" for ask in ASKS[:2]}  # the query turns were judged
        assert {t["id"] for t in select_query_turns(world.store)} == set(query_ids)
        loop.close()

    with pytest.raises(TypeError, match="judge must be"):
        as_reward(42)
    loop = SlowLoop(world.store, world.backend, config=CONFIG)
    with pytest.raises(ValueError, match="judge="):
        loop.train_now(steps=1)


# -- the scheduler decides when ---------------------------------------------------------------
def test_training_only_in_idle_windows_pauses_and_resumes(world, tiny_model):
    from metaclaw.slowloop.backends import make_backend

    now = [datetime(2026, 11, 20, 12, 0, tzinfo=timezone.utc).timestamp()]  # midday: active
    last_input = [now[0] - 30]
    scheduler_config = {"mode": "all", "min_window_s": 0, "signals": {
        "sleep": {"start": "01:00", "end": "06:00", "tz": "UTC"},
        "keyboard": {"threshold_s": 600, "last_input": lambda: last_input[0]}}}
    state_dir = world.root / "state"
    loop = SlowLoop(world.store, world.backend, config=CONFIG, judge=world.reward,
                    proxy=world.proxy, scheduler_config=scheduler_config, state_dir=state_dir,
                    clock=lambda: now[0])
    world.serve_query_turns()
    scheduler = loop.start(poll_s=0.02)
    assert loop.scheduler is scheduler
    time.sleep(0.4)  # ~20 ticks while the user is active
    assert scheduler.state == "waiting" and loop.trainer.steps_done == 0
    assert world.store.frame("training_steps").height == 0

    # night, no input for an hour: the window opens and steps run
    now[0] = datetime(2026, 11, 21, 2, 0, tzinfo=timezone.utc).timestamp()
    last_input[0] = now[0] - 3600
    wait_until(lambda: loop.trainer.steps_done >= 2, what="training in the window")

    # the user is back: training pauses at the next step boundary and stays paused
    last_input[0] = now[0]
    wait_until(lambda: scheduler.state == "waiting", what="the pause")
    paused_at = loop.trainer.steps_done
    time.sleep(0.3)
    assert loop.trainer.steps_done == paused_at == scheduler.steps
    steps = world.store.frame("training_steps")
    assert steps["step"].to_list() == list(range(paused_at))  # only whole steps were recorded
    assert loop.responder.policy_version == world.backend.policy_version >= 1

    # away again later that night: training resumes where it stopped
    now[0] += 2 * 3600
    wait_until(lambda: loop.trainer.steps_done >= paused_at + 2, what="the resume")
    loop.stop()
    total = loop.trainer.steps_done
    steps = world.store.frame("training_steps")
    assert steps["step"].to_list() == list(range(total)) and steps["run_id"].n_unique() == 1
    moves = [(t["from_state"], t["to_state"])
             for t in world.store.query("SELECT * FROM scheduler_transitions ORDER BY id")]
    run = [("waiting", "window_open"), ("window_open", "training"), ("training", "pausing"),
           ("pausing", "waiting")]
    assert moves[:4] == run and moves[4:6] == run[:2]
    saved = json.loads((state_dir / "latest.json").read_text())
    assert saved["step"] == total - 1

    # a new process resumes the run from the saved state; --now trains while the user is active
    last_input[0] = now[0]
    backend = make_backend("local", tiny_model, lora_rank=8, seed=5)
    again = SlowLoop(world.store, backend, config=CONFIG, judge=world.reward,
                     scheduler_config=scheduler_config, state_dir=state_dir, clock=lambda: now[0])
    assert again.trainer.next_step == total and again.trainer.run_id == saved["run_id"]
    assert backend.policy_version == world.backend.policy_version
    forced = again.start(now=True, steps=1, poll_s=0.02)
    wait_until(lambda: forced.steps == 1 and forced.state == "waiting", what="the forced step")
    again.stop()
    assert world.store.frame("training_steps")["step"].to_list() == list(range(total + 1))
    loop.close()


# -- hot-swap through the proxy under load ----------------------------------------------------
def test_hot_swap_through_the_proxy_under_50_concurrent_requests(world):
    loop = SlowLoop(world.store, world.backend, config=CONFIG, judge=world.reward,
                    proxy=world.proxy)
    world.serve_query_turns(ASKS[:2])
    served_before = len(world.store.turns())
    training = threading.Thread(target=loop.train_now, kwargs={"steps": 4})
    failures: list[str] = []
    headers: list[int] = []

    async def wave(client: openai.AsyncOpenAI) -> None:
        async def one(i: int) -> None:
            messages = [{"role": "user", "content": ASKS[i % 3]}]
            try:
                if i % 2:
                    stream = await client.chat.completions.create(
                        model="tiny", messages=messages, max_tokens=4, seed=i, stream=True)
                    chunks = [c async for c in stream]
                    assert chunks and chunks[-1].choices[0].finish_reason
                else:
                    raw = await client.chat.completions.with_raw_response.create(
                        model="tiny", messages=messages, max_tokens=4, seed=i)
                    assert "metaclaw" not in raw.http_response.json()
                    headers.append(int(raw.headers["X-MetaClaw-Policy-Version"]))
            except Exception as exc:  # reported below
                failures.append(repr(exc))

        await asyncio.gather(*(one(i) for i in range(50)))

    async def drive() -> int:
        async with openai.AsyncOpenAI(base_url=world.proxy.url, api_key="unused",
                                      max_retries=0, timeout=60) as client:
            training.start()
            waves = 0
            while training.is_alive() and waves < 8:
                await wave(client)
                waves += 1
            training.join()
            await wave(client)  # and one wave after the last swap
            return waves + 1

    waves = asyncio.run(drive())
    assert failures == []
    world.proxy.flush()
    turns = world.store.turns()[served_before:]
    assert len(turns) == 50 * waves and {t["status"] for t in turns} == {"ok"}
    versions = [t["policy_version"] for t in turns]
    assert set(versions) <= set(range(5)) and len(set(versions)) >= 2  # served across swaps
    assert versions[-50:] == [4] * 50 and headers[-25:] == [4] * 25
    assert all(len(t["completion_tokens_ids"]) == t["completion_tokens"] for t in turns)
    loop.close()


# -- train on exactly what was served -------------------------------------------------------
TOOLS = [{"type": "function", "function": {
    "name": "weather", "description": "the weather", "parameters": {"type": "object"}}}]


def test_a_training_datum_holds_exactly_the_served_token_ids(world):
    """A turn served with tools through the proxy: its recorded prompt token ids (what the
    policy read), the query-set prompt rendered for training, and the prompt part of its
    training datum are the same ids; the tools are in them."""
    from metaclaw.slowloop.backends import Datum, render_request
    from metaclaw.slowloop.grpo import prompts_from_query_set

    SlowLoop(world.store, world.backend, config=CONFIG, judge=world.reward, proxy=world.proxy)
    world.ask("what is the weather", tools=TOOLS)
    world.proxy.flush()
    buffers.refresh(world.store)
    [turn] = world.store.turns()
    served = turn["prompt_tokens_ids"]
    assert turn["request_params"]["tools"] == TOOLS
    without_tools = world.backend.render_chat(turn["request_messages"])
    assert served != without_tools and len(served) > len(without_tools)  # tools are rendered
    [prompt] = prompts_from_query_set(world.store, world.backend)
    assert prompt.tokens == served == render_request(world.backend, turn)
    datum = Datum.from_sample(prompt.tokens, turn["completion_tokens_ids"],
                              turn["completion_logprobs"], 1.0)
    full = datum.model_input + datum.target_tokens[-1:]
    assert full == served + turn["completion_tokens_ids"]


def test_the_judge_sees_the_served_turns_consequence(world):
    """The PRM reward of a sampled completion carries the served turn's consequence: the tool
    result and the user's next message, read from the session's next turns."""
    from metaclaw.slowloop.loop import turn_evidence

    SlowLoop(world.store, world.backend, config=CONFIG, judge=world.reward, proxy=world.proxy)
    first = [{"role": "user", "content": "weather please"}]
    world.client.chat.completions.create(model="tiny", messages=first, max_tokens=3,
                                         tools=TOOLS, extra_headers={"X-Session-Id": "e"})
    second = first + [{"role": "assistant", "content": None, "tool_calls": [{
        "id": "c1", "type": "function", "function": {"name": "weather", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny, 21 C"},
        {"role": "user", "content": "wrong city, I meant Berlin"}]
    world.client.chat.completions.create(model="tiny", messages=second, max_tokens=3,
                                         extra_headers={"X-Session-Id": "e"})
    world.proxy.flush()
    head, tail = world.store.turns()
    evidence = turn_evidence(world.store, head)
    assert "sunny, 21 C" in evidence and "wrong city, I meant Berlin" in evidence
    assert turn_evidence(world.store, tail) is None


def test_sampling_temperature_other_than_one_is_rejected():
    with pytest.raises(ValueError, match="temperature must be 1.0"):
        GRPOConfig(temperature=0.7).check()


def test_checkpoint_retention_and_the_store_is_the_truth_across_restarts(world, tiny_model):
    """Saved states: the last ``keep_checkpoints`` and every published version's are kept. A
    restarted process, and another process sharing the workspace (its own state folder),
    serve the store's latest published version with exactly its weights."""
    import dataclasses

    from metaclaw.slowloop.backends import make_backend

    config = dataclasses.replace(CONFIG, publish_every=2, save_every=1, keep_checkpoints=1)
    loop = SlowLoop(world.store, world.backend, config=config, judge=world.reward,
                    proxy=world.proxy, state_dir=world.root / "state")
    world.serve_query_turns()
    assert loop.train_now(steps=4).steps_done == 4
    versions = world.store.query("SELECT version, checkpoint FROM policy_versions")
    assert [v["version"] for v in versions] == [1, 2]
    kept = sorted(p.name for p in (world.root / "state").glob("step-*"))
    assert kept == ["step-000001", "step-000003"]  # step 1 published v1; step 3 is v2 and last
    # an older published version keeps its weights, not the optimizer's state (2/3 of a state)
    assert not (world.root / "state" / "step-000001" / "optimizer.pt").exists()
    assert (world.root / "state" / "step-000001" / "adapter_model.safetensors").is_file()
    assert (world.root / "state" / "step-000003" / "optimizer.pt").is_file()
    assert [v["checkpoint"].rsplit("/", 1)[-1] for v in versions] == kept
    prompt = world.backend.render_chat([{"role": "user", "content": "say yes"}])
    expected = world.backend.sampler().sample(prompt, 2, 6, 1.0, seed=5)
    loop.close()

    for state_dir in ("state", "other-process-state"):
        backend = make_backend("local", tiny_model, lora_rank=8, seed=1)
        again = SlowLoop(world.store, backend, config=config, judge=world.reward,
                         state_dir=world.root / state_dir)
        assert backend.policy_version == 2 == again.status()["policy_version"]
        got = backend.sampler().sample(prompt, 2, 6, 1.0, seed=5)
        assert [s.tokens for s in got] == [s.tokens for s in expected]
        again.close()

    # the workspace's folder moved (or copied): the recorded paths are gone; the states are
    # found by name in the state folder, and a published version's weights are never pruned
    (world.root / "state").rename(world.root / "moved")
    backend = make_backend("local", tiny_model, lora_rank=8, seed=1)
    moved = SlowLoop(world.store, backend, config=config, judge=world.reward,
                     state_dir=world.root / "moved")
    assert backend.policy_version == 2
    got = backend.sampler().sample(prompt, 2, 6, 1.0, seed=5)
    assert [s.tokens for s in got] == [s.tokens for s in expected]
    assert moved.trainer._prune_checkpoints() == []
    assert sorted(p.name for p in (world.root / "moved").glob("step-*")) == kept
    moved.close()
    from metaclaw.slowloop.backends import locate_checkpoint

    assert locate_checkpoint(versions[1]["checkpoint"], world.root / "moved", 2) == str(
        world.root / "moved" / "step-000003")
    # another state of the same name (another machine's folder) is not taken for version 2
    assert locate_checkpoint(versions[1]["checkpoint"], world.root / "moved", 5) == \
        versions[1]["checkpoint"]


def test_a_step_stopped_after_its_update_keeps_the_weights_its_turns_are_counted_in(world):
    """Stopped between the gradient update and the publish (Ctrl-C, a failed save): its turns
    count as trained, so the weights that trained on them are saved when the loop closes, as
    that step's state; before, they were counted and the weights lost."""
    import json

    loop = SlowLoop(world.store, world.backend, config=CONFIG, judge=world.reward,
                    proxy=world.proxy, state_dir=world.root / "state")
    world.serve_query_turns()

    def stopped(*args, **kwargs):
        raise KeyboardInterrupt
    world.backend.publish = stopped
    with pytest.raises(KeyboardInterrupt):
        loop.train_now(steps=1)
    counted = world.store.query("SELECT COUNT(*) AS n FROM turns WHERE trained_steps > 0")
    assert counted[0]["n"] > 0
    loop.close()
    latest = json.loads((world.root / "state" / "latest.json").read_text())
    assert latest["step"] == 0 and (world.root / "state" / "step-000000").is_dir()


def test_a_step_retried_under_a_saved_steps_number_saves_its_update(world, monkeypatch):
    """A step whose record failed after its update is saved (close, stop); the step retried
    under the same number trains again, and its update is saved too, not skipped as that
    number's state already written."""
    import dataclasses
    import json
    from pathlib import Path

    config = dataclasses.replace(CONFIG, publish_every=2)  # no publish: only the saves keep it
    loop = SlowLoop(world.store, world.backend, config=config, judge=world.reward,
                    proxy=world.proxy, state_dir=world.root / "state")
    world.serve_query_turns()
    real, calls = world.store.record_training_step, []

    def fails_once(**fields):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("the store failed while recording the step")
        return real(**fields)

    monkeypatch.setattr(world.store, "record_training_step", fails_once)
    with pytest.raises(RuntimeError):
        loop.train_now(steps=1)
    assert loop.trainer.save() is not None  # the failed step's update, saved
    trained = world.backend.steps
    world.serve_query_turns()
    assert loop.train_now(steps=1).steps_done == 1  # retried under the same number
    assert world.backend.steps == trained + 1
    loop.close()
    latest = json.loads((world.root / "state" / "latest.json").read_text())
    saved = json.loads((Path(latest["checkpoint"]) / "metaclaw_state.json").read_text())
    assert saved["steps"] == trained + 1


def test_a_reward_named_on_the_command_line_loads_as_the_user_wrote_it(tmp_path, monkeypatch):
    from metaclaw.slowloop.grpo import load_reward

    (tmp_path / "graded.py").write_text(
        "from __future__ import annotations\nfrom dataclasses import dataclass\n\n"
        "@dataclass\nclass Rubric:\n    words: int = 3\n\n"
        "def short(prompt, text):\n    return -abs(len(text.split()) - Rubric().words)\n")
    (tmp_path / "broken.py").write_text("raise ValueError('missing API key for grader')\n")
    assert load_reward(f"{tmp_path / 'graded.py'}:short")(None, "a b c") == 0
    monkeypatch.chdir(tmp_path)  # a module beside the user, as `python -m` finds it
    assert load_reward("graded:short")(None, "a b") == -1
    with pytest.raises(ValueError, match="cannot load broken.py: ValueError: missing API key"):
        load_reward("broken.py:anything")
