"""The magics in real Jupyter kernels (jupyter_client), the way a notebook runs them: a user
interrupting a long ``%metaclaw`` call with the stop button (SIGINT to the kernel)."""

import gc
import json
import queue
import signal
import time

import pytest

from metaclaw.offline.double import DoubleServer, Reply
from metaclaw.store import Store

jupyter_client = pytest.importorskip("jupyter_client.manager")


class Kernel:
    """One real IPython kernel with its client; :meth:`run` returns the cell's text output."""

    def __init__(self):
        self.manager, self.client = jupyter_client.start_new_kernel(kernel_name="python3")

    def send(self, code: str) -> str:
        return self.client.execute(code)

    def output(self, msg_id: str, timeout: float = 60) -> str:
        out, deadline = [], time.monotonic() + timeout
        while True:
            try:
                msg = self.client.get_iopub_msg(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"the kernel did not finish the cell in {timeout} s")
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                out.append(content["text"])
            elif kind in ("execute_result", "display_data"):
                out.append(content["data"].get("text/plain", ""))
            elif kind == "error":
                out.append("Traceback: " + content["ename"])
            elif kind == "status" and content["execution_state"] == "idle":
                return "".join(out)

    def run(self, code: str, timeout: float = 60) -> str:
        return self.output(self.send(code), timeout)

    def close(self):
        self.client.stop_channels()
        self.manager.shutdown_kernel(now=True)


@pytest.fixture()
def kernel():
    k = Kernel()
    yield k
    k.close()


def _wait_for(condition, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def _interrupt_when_called(kernel, code, double):
    """Run ``code``, press stop once ``double`` got its first request, return the output."""
    seen = len(double.requests)
    msg_id = kernel.send(code)
    _wait_for(lambda: len(double.requests) > seen)
    kernel.manager.interrupt_kernel()
    return kernel.output(msg_id)


SLOW_S = 4.0


def test_interrupting_evolve_cancels_it_and_nothing_lands_later(kernel, tmp_path):
    operations = {"operations": [{"op": "add", "name": "late-skill", "description": "d",
                                  "category": "c", "body": "Do it carefully.", "reason": "r",
                                  "evidence": [1]}]}
    calls = []

    def answer(_body):  # the first answer is slow, the next one prompt
        calls.append(1)
        return Reply(json.dumps(operations), delay=SLOW_S if len(calls) == 1 else 0)

    with DoubleServer(answer) as evolver:
        kernel.run("%load_ext metaclaw\nimport polars")
        kernel.run(f"rt = %metaclaw start --sim --db {tmp_path}/m.db --skills {tmp_path}/skills "
                   f"--retrieval lexical --evolver-url {evolver.url} --evolver-model e")
        kernel.run("get_ipython().run_cell_magic('metaclaw', 'chat', 'hi'); rt.proxy.flush()\n"
                   "rt.store.execute(\"UPDATE turns SET reward = -1, buffer_set = 'support', "
                   "buffer_state = 'live'\")")
        started = time.monotonic()
        out = _interrupt_when_called(kernel, "%metaclaw evolve", evolver)
        assert time.monotonic() - started < SLOW_S  # the stop button is heeded at once
        assert "%metaclaw evolve: interrupted" in out and "unchanged (generation 0)" in out
        assert "Traceback" not in out
        time.sleep(SLOW_S)  # when the evolver would have answered
        store = Store(str(tmp_path / "m.db"))
        try:
            assert store.latest_generation() == 0  # no skill landed behind the user's back
        finally:
            store.close()
        # the kernel and the evolver's lock are free: the next evolve runs to its end
        out = kernel.run("e = %metaclaw evolve\nprint(e.status, e.generation)")
        assert "applied 1" in out


def test_interrupting_score_releases_the_turns_at_once(kernel, tmp_path):
    with DoubleServer(lambda _body: Reply("Score: 1", delay=SLOW_S)) as judge:
        kernel.run("%load_ext metaclaw\nimport polars")
        kernel.run(f"rt = %metaclaw start --db {tmp_path}/m.db --skills {tmp_path}/skills "
                   f"--retrieval lexical --judge-url {judge.url} --judge-model j --votes 1")
        kernel.run("for i in range(3):\n"
                   "    get_ipython().run_cell_magic('metaclaw', 'chat', f'hello {i}')\n"
                   "rt.proxy.flush()")
        out = _interrupt_when_called(kernel, "%metaclaw score", judge)
        assert "%metaclaw score: interrupted" in out and "Traceback" not in out
        store = Store(str(tmp_path / "m.db"))
        try:  # another kernel may judge these turns now, not in ten minutes
            rows = store.query("SELECT reward, judge_lease_until FROM turns")
            assert rows and all(r["judge_lease_until"] is None for r in rows)
            assert all(r["reward"] is None for r in rows)
        finally:
            store.close()


def test_run_sync_cancels_its_work_on_an_interrupt_before_raising_it():
    """Inside a running loop (as in a kernel) the work runs in a worker thread: an interrupt of
    the waiting thread cancels it and waits for it to unwind, then is raised."""
    import _thread
    import asyncio
    import threading

    from metaclaw.aio import run_sync

    unwound = []

    async def work():
        try:
            await asyncio.sleep(30)
        finally:
            await asyncio.sleep(0.2)  # a release that itself awaits (closing a client)
            unwound.append(time.monotonic())

    async def cell():
        threading.Timer(0.3, _thread.interrupt_main).start()
        started = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            run_sync(work)
        return started

    loop = asyncio.new_event_loop()  # not asyncio.run, whose own SIGINT handler a kernel lacks
    collecting = gc.isenabled()
    gc.disable()  # a gc callback (hypothesis installs one) would swallow the interrupt
    # code run earlier in this worker may have left SIGINT without Python's own handler, and
    # interrupt_main then calls that one (or, for SIG_IGN, does nothing) instead of raising
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        started = loop.run_until_complete(cell())
    finally:
        loop.close()
        signal.signal(signal.SIGINT, handler)
        if collecting:
            gc.enable()
    assert unwound and unwound[0] - started < 5  # cancelled, and unwound before the raise
