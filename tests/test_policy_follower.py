"""A serving process follows the policy versions any process of the workspace publishes: it
adopts a newer version while it runs (loaded in a background thread, swapped atomically), serves
the latest one after a restart, and keeps serving what it served when a version was trained on
another base model or its checkpoint is missing or broken."""

from __future__ import annotations

import functools
import json
import subprocess
import threading

import openai
import pytest

from metaclaw.offline.double import DoubleServer, Reply
from metaclaw.store import Store
import waiting
from test_cli import CLI, free_port, wait_for_port

ASK = [{"role": "user", "content": "say yes"}]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    import torch

    from metaclaw.offline.tinymodel import write_tiny_model

    torch.set_num_threads(1)  # a tiny model runs fastest on one thread, more so on a busy box
    return str(write_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0))


wait_until = functools.partial(waiting.wait_until, timeout=20.0, interval=0.05)


def _ask(client, session, text="say yes", stream=False):
    """One chat request; returns (policy version header, reply text)."""
    raw = client.chat.completions.with_raw_response.create(
        model="tiny", messages=[{"role": "user", "content": text}], max_tokens=6,
        extra_headers={"X-Session-Id": session}, stream=stream)
    reply = raw.parse()
    text = ("".join(c.choices[0].delta.content or "" for c in reply if c.choices) if stream
            else reply.choices[0].message.content)
    return raw.headers["x-metaclaw-policy-version"], text


def _parity_judge(body):
    """A scripted judge (not a model): +1 for a reply of odd length, -1 otherwise, so that the
    samples of a group differ and GRPO has something to learn from."""
    from metaclaw.fastloop.judge import SECTION_REPLY, parse_judge_prompt

    reply = parse_judge_prompt(body["messages"][-1]["content"])[SECTION_REPLY]
    return Reply(json.dumps({"score": 1 if len(reply) % 2 else -1, "rationale": "scripted"}))


def _adopted(store, version):
    return [e for e in store.events(kind="policy_adopted") if e["detail"]["version"] == version]


TRAINER = """
import sys
from metaclaw.slowloop.backends import make_backend
from metaclaw.slowloop.grpo import GRPOConfig
from metaclaw.fastloop.judge import Judge
from metaclaw.slowloop.loop import SlowLoop
from metaclaw.store import Store

db, model, state_dir, judge_url = sys.argv[1:]
backend = make_backend("local", model, device="cpu", num_threads=1)
config = GRPOConfig(steps=1, group_size=4, groups_per_step=2, max_tokens=6, learning_rate=0.05)
loop = SlowLoop(Store(db), backend, config=config, judge=Judge(judge_url, "j", votes=1),
                serve=False, state_dir=state_dir)
print("ready", flush=True)
sys.stdin.readline()          # the query turns are served: train on them
print(loop.train_now(1).policy_version, flush=True)
"""


def test_a_running_server_adopts_the_version_another_process_trains(tmp_path, tiny_model):
    """`metaclaw serve --local-model` in one process, the slow loop (what `metaclaw train
    --now` runs) in another, on the turns the server served: the next request is answered by
    the new version (header and recorded turn) without a restart, and a restarted server
    serves it from its first request."""
    import sys

    from metaclaw import buffers
    from metaclaw.runtime import Runtime

    db, skills, port = tmp_path / "ws.db", tmp_path / "skills", free_port()
    server = subprocess.Popen([str(a) for a in [
        *CLI, "serve", "--local-model", tiny_model, "--port", port, "--db", db,
        "--skills", skills, "--retrieval", "lexical"]],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    with DoubleServer(_parity_judge) as judge:
        # started together: the trainer loads its model while the server starts
        trainer = subprocess.Popen([sys.executable, "-c", TRAINER, str(db), tiny_model,
                                    str(tmp_path / "train"), judge.url],
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True)
        try:
            wait_for_port(server, port)
            assert "(policy version 0, following the versions" in server.stdout.readline()
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x")
            assert _ask(client, "a")[0] == "0"
            assert _ask(client, "b", "answer yes or no")[0] == "0"
            store = Store(db)
            wait_until(lambda: len(store.turns()) == 2)
            buffers.refresh(store)  # what `metaclaw buffers` / the judge do: both are query turns
            assert len(store.turns("buffer_set = 'query' AND buffer_state = 'live'")) == 2

            assert trainer.stdout.readline().strip() == "ready", trainer.stderr.read()
            out, err = trainer.communicate("go\n", timeout=120)
            assert trainer.returncode == 0 and out.strip() == "1", err
            published = store.query("SELECT version, checkpoint FROM policy_versions")
            assert [p["version"] for p in published] == [1] and published[0]["checkpoint"]

            wait_until(lambda: _adopted(store, 1), timeout=60)  # loads peft on first use
            assert _ask(client, "c")[0] == "1"
            assert _ask(client, "d", stream=True)[0] == "1"
            wait_until(lambda: len(store.turns("session_id IN ('c', 'd')")) == 2)
            turns = store.turns("session_id IN ('a', 'b', 'c', 'd')")
            assert [t["policy_version"] for t in turns] == [0, 0, 1, 1]
            assert server.poll() is None
        finally:
            for proc in (trainer, server):
                if proc.poll() is None:
                    proc.terminate()
                proc.wait(timeout=20)

    restarted = Runtime.start(local_model=tiny_model, db_path=str(db), skills_dir=str(skills),
                              retrieval="lexical")
    try:
        version, _ = _ask(restarted.client(), "e")
        assert version == "1" and restarted.proxy.policy_version == 1
    finally:
        restarted.stop()


def _trained_state(tiny_model, state_dir):
    """Train the tiny model one step in this process and save its state (a checkpoint as the
    slow loop saves it). Returns (backend, checkpoint path)."""
    from metaclaw.slowloop.backends import Datum, make_backend

    backend = make_backend("local", tiny_model, lora_rank=4, seed=0, device="cpu")
    prompt = backend.render_chat(ASK)
    samples = backend.sample(prompt, n=4, max_tokens=6, seed=1)
    backend.train_step([Datum.from_sample(prompt, s.tokens, s.logprobs, a)
                        for s, a in zip(samples, [1.0, -1.0, 1.0, -1.0])], "ppo", 0.05)
    backend.publish()
    return backend, backend.save_state(str(state_dir))


def test_versions_it_cannot_serve_are_reported_once_and_it_keeps_serving(tmp_path, tiny_model):
    """Another base model, another backend, a missing checkpoint, a broken one: each is one
    clear event, the server keeps serving version 0 and answers every request; a version
    without its checkpoint yet waits for it; a restart serves the latest servable version."""
    from metaclaw.offline.tinymodel import write_tiny_model
    from metaclaw.runtime import Runtime

    db = str(tmp_path / "ws.db")
    runtime = Runtime.start(local_model=tiny_model, db_path=db,
                            skills_dir=str(tmp_path / "skills"), retrieval="lexical")
    try:  # what answers is named: the local model, not the double it is served through
        served = runtime.proxy.responder.model_name
        assert repr(runtime).endswith(f"-> local language model {served}>")
        assert runtime.status()["upstream"] == f"local language model {served}"
        assert runtime.status()["model"] == served
        store, client = Store(db), runtime.client()
        reply = client.chat.completions.create(  # was labelled the simulated model's
            model="whatever", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
        assert reply.model == served != "sim-agent"
        other = write_tiny_model(tmp_path / "other-tiny", seed=1)
        backend, good = _trained_state(tiny_model, tmp_path / "good")
        bad = {
            store.add_policy_version(backend="local", base_model=str(other),
                                     checkpoint=good): "base model",
            store.add_policy_version(backend="tinker", base_model="Qwen/Qwen3-4B",
                                     checkpoint="tinker://run/weights/1"): "tinker backend",
            store.add_policy_version(backend="local", base_model=tiny_model,
                                     checkpoint=str(tmp_path / "gone")): "no metaclaw_state",
        }
        broken = tmp_path / "broken"
        broken.mkdir()
        for f in (tmp_path / "good").iterdir():  # a copy of a good state, its adapter cut
            (broken / f.name).write_bytes(f.read_bytes())
        (broken / "adapter_model.safetensors").write_bytes(b"\x00" * 40)
        bad[store.add_policy_version(backend="local", base_model=tiny_model,
                                     checkpoint=str(broken))] = "cannot load the LoRA adapter"

        events = wait_until(lambda: len(store.events(level="warning") + store.events(
            level="error")) == 4 and store.events(level="warning") + store.events(level="error"))
        for version, reason in bad.items():
            event = next(e for e in events if e["detail"]["version"] == version)
            assert reason in event["message"] and "still serving policy version 0" in \
                event["message"]
            assert event["kind"] == ("policy_load_failed" if version >= 3 else
                                     "policy_not_adopted")
        assert _ask(client, "s")[0] == "0"
        assert runtime.proxy.policy_version == 0

        # the slow loop's order: the row first, its checkpoint right after
        pending = store.add_policy_version(backend="local", base_model=backend.base_model)
        assert _ask(client, "t")[0] == "0"  # committed turns wake the follower; still pending
        store.execute("UPDATE policy_versions SET checkpoint = ? WHERE version = ?",
                      (good, pending))
        wait_until(lambda: _adopted(store, pending))
        assert _ask(client, "u")[0] == str(pending)
        assert len(store.events(level="warning") + store.events(level="error")) == 4  # once each
        expected = backend.sampler().sample(backend.render_chat(ASK), 2, 6, 1.0, seed=5)
        served = runtime.proxy.responder._serving.sampler.sample(
            backend.render_chat(ASK), 2, 6, 1.0, seed=5)
        assert [s.tokens for s in served] == [s.tokens for s in expected]  # its exact weights
    finally:
        runtime.stop()

    newest_broken = store.add_policy_version(backend="local", base_model=tiny_model,
                                             checkpoint=str(broken))
    restarted = Runtime.start(local_model=tiny_model, db_path=db,
                              skills_dir=str(tmp_path / "skills"), retrieval="lexical")
    try:
        assert _ask(restarted.client(), "v")[0] == str(pending)  # the latest servable one
        assert any(e["detail"]["version"] == newest_broken
                   for e in store.events(kind="policy_load_failed"))
    finally:
        restarted.stop()


def test_many_versions_of_another_base_model_are_said_in_one_line(tmp_path, tiny_model,
                                                                  caplog):
    """A workspace that trained another base model for a while: a server of this one says
    once which versions it leaves, not a warning per version; each is still an event."""
    import logging

    from metaclaw.runtime import Runtime

    db = str(tmp_path / "ws.db")
    store = Store(db)
    versions = [store.add_policy_version(backend="local", base_model=str(tmp_path / "other"),
                                         checkpoint=str(tmp_path / f"step-{n}"))
                for n in range(3)]
    with caplog.at_level(logging.WARNING, logger="metaclaw"):
        runtime = Runtime.start(local_model=tiny_model, db_path=db,
                                skills_dir=str(tmp_path / "skills"), retrieval="lexical")
        try:
            wait_until(lambda: len(store.events(kind="policy_not_adopted")) == 3)
        finally:
            runtime.stop()
    said = [r.getMessage() for r in caplog.records if "not adopted" in r.getMessage()]
    assert said == [f"policy versions {', '.join(map(str, versions))} not adopted (newest: "
                    + said[0].split("(newest: ", 1)[1]], said
    assert "still serving policy version 0" in said[0]


def test_loading_a_version_never_blocks_requests(tmp_path, tiny_model):
    """While a new version's checkpoint loads (held here at a gate), requests are answered by
    the old version; the swap happens once it is loaded, and the next request gets it."""
    from metaclaw.runtime import Runtime
    from metaclaw.slowloop.policy import PolicyFollower

    db = str(tmp_path / "ws.db")
    runtime = Runtime.start(local_model=tiny_model, db_path=db,
                            skills_dir=str(tmp_path / "skills"), retrieval="lexical")
    runtime.extras.pop("policy_follower").stop()
    responder = runtime.proxy.responder
    entered, release = threading.Event(), threading.Event()

    def gated_load(*row):
        entered.set()
        assert release.wait(30)
        return responder.backend.published_sampler(*row)

    follower = PolicyFollower(runtime.store, responder, gated_load, proxy=runtime.proxy,
                              poll_s=0.05).start()
    try:
        store, client = Store(db), runtime.client()
        backend, checkpoint = _trained_state(tiny_model, tmp_path / "state")
        version = store.add_policy_version(backend="local", base_model=backend.base_model,
                                           checkpoint=checkpoint)
        assert entered.wait(20)
        for i in range(3):
            assert _ask(client, f"during-{i}", stream=bool(i % 2))[0] == "0"
        release.set()
        wait_until(lambda: responder.policy_version == version)
        assert _ask(client, "after")[0] == str(version)
    finally:
        release.set()
        follower.stop()
        runtime.stop()
