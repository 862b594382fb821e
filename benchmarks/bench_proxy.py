"""What the MetaClaw proxy adds to each request, measured against calling the upstream directly.

Separate processes, so none shares an interpreter lock with another:

- upstream: the offline double (:class:`metaclaw.offline.double.DoubleServer`, a scripted server, not a
  model) answering every request at once with an echo of the user message (streams: one chunk
  per word);
- proxy: ``python -m metaclaw serve --upstream <double> --retrieval lexical`` over a library of
  20 skills and a fresh workspace database (with ``--embedding``, a second proxy with
  ``--retrieval embedding`` runs beside it);
- floor: ``benchmarks/passthrough.py``, a bare aiohttp pass-through in its own process (receives
  the body, forwards it unchanged with one pooled client session, relays the reply; no parsing,
  retrieval or recording), on the same event loop as the proxy: the least any proxy in this
  framework adds; and the recording floor beside it, the same pass-through committing each
  exchange (request and reply bytes) to SQLite before the reply ends (``passthrough.py
  --record``): the least a recording proxy adds, the CPU target's baseline;
- client: this script, using ``httpx`` (not the ``openai`` SDK, whose typed request/response
  handling would add its own milliseconds to both sides).

With ``--protocols openai,anthropic`` (the default) the Anthropic Messages side is measured in the
same run, side by side: an offline Anthropic double (:mod:`metaclaw.offline.double_anthropic`, scripted
echo built on the SDK's types) is the direct baseline, against ``proxy[lexical] anthropic->anthropic``
(pass-through to that double, ``--upstream-protocol anthropic``) and ``proxy[lexical]
anthropic->openai`` (Anthropic requests translated to the OpenAI double and back). Every proxy is
its own process and gets the same requests. With ``responses`` in ``--protocols`` (beside
``openai``), ``proxy[lexical] responses->openai`` (OpenAI Responses requests translated to the
chat double and back) joins the OpenAI group, and its added p50 and CPU per request are printed
beside the chat proxy's.

Every target gets the same requests (unique user messages, so no query cache helps). Sequential
requests are interleaved one by one with the target order rotating each time, so drift in the
machine's load falls on all targets alike; concurrent batches alternate in rounds. Warm-up
requests are not measured. Printed: p50/p95/p99/mean latency of non-streaming requests, of the
time to first stream chunk and of whole streams, direct vs proxied, the added milliseconds and the
ratio proxied/direct; then throughput at ``--concurrency`` parallel requests (asyncio client) and
its ratio proxied/direct; then CPU time per request spent in the proxy process (and, from the
proxy's ``/healthz``, the share of it spent writing turns to the store) and the number of turns
the proxy recorded. Last, the targets: ``proxy[lexical]`` (each reply's end sent only once its
turn is committed, so that it survives ``kill -9``; every turn recorded) against the floor, as
ratios from this run, each with PASS or FAIL:

- added p50 latency (proxy p50 - direct p50) / (floor p50 - direct p50), non-streaming and time
  to first chunk: at most 3x;
- throughput at ``--concurrency`` (non-streaming and streaming), proxy / floor: at least 0.8x;
- CPU per request (user + system, over every measured request, at least 2,000 with the
  defaults), proxy / recording floor: at most 2x (the proxy parses, retrieves and records a
  turn; the recording floor only forwards and commits bytes).

Printed for reference, with no target: the added p50 against the recording floor's, and the CPU
per request against the bare floor's.

With ``--db postgresql`` (a throwaway PostgreSQL 15 cluster started for the run, fsync on, on a
Unix socket; ``tests/pgcluster.py``) or ``--db postgresql://...``, ``proxy[lexical,postgresql]``
serves the same requests with its workspace on PostgreSQL, beside the SQLite proxy: its added p50
and CPU per request are printed against the SQLite engine's (target: within 1.5x), with the
database server's own CPU per request beside them.

With ``--baseline-tree DIR`` (another checkout of the project, e.g. ``git worktree add /tmp/before
<commit>``), ``proxy[lexical,baseline]`` runs that tree's code beside this one's on the same
requests: a change's effect on the proxy, before and after, measured in one run.

Exits 1 when any request fails or a turn is lost (and, with ``--check-targets``, when a target
fails).

    python benchmarks/bench_proxy.py [--requests 500] [--concurrency 16] [--embedding]
                                     [--protocols openai,anthropic] [--durable-acks]
                                     [--fsync-acks] [--check-targets]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import socket
import sqlite3
import subprocess
import sys
import tempfile
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

MODEL = "double-model"
SYSTEM = "You are a careful software agent working in the user's repository."

DOUBLE_PROCESS = """
import sys
from metaclaw.offline.double import DoubleServer
double = DoubleServer(models=({model!r},)).start()  # no script: echoes at once, no delay
print(double.port, flush=True)
sys.stdin.read()  # serve until the benchmark closes our stdin
double.stop()
"""

ANTHROPIC_DOUBLE_PROCESS = """
import sys
from metaclaw.offline.double_anthropic import AnthropicDoubleServer
double = AnthropicDoubleServer().start()  # no script: echoes at once, no delay
print(double.port, flush=True)
sys.stdin.read()
double.stop()
"""
#: Target name -> wire protocol of its requests (targets not listed speak OpenAI chat).
PROTOCOL_OF: dict[str, str] = {}
#: The floor's target name, and the proxy the targets are checked for.
FLOOR = "floor[pass-through]"
#: The pass-through that also commits each exchange to SQLite (the CPU target's baseline).
RECORDING_FLOOR = "floor[pass-through+sqlite]"
CHECKED = "proxy[lexical]"
#: Targets: added p50 <= 3x the floor's, throughput >= 0.8x the floor's, CPU per request <= 2x
#: the recording floor's.
MAX_ADDED_RATIO, MIN_THROUGHPUT_RATIO, MAX_CPU_RATIO = 3.0, 0.8, 2.0
#: Requests the CPU ratio should be measured over.
CPU_REQUESTS = 2000

EXTRA_SKILLS = [
    ("run-tests-after-change", "testing", "After changing code, run the relevant tests and report "
     "failures with their output before claiming the change works."),
    ("small-commits", "coding", "Group edits into small, focused commits with messages that say "
     "why the change was made."),
    ("pin-dependencies", "coding", "When adding a dependency, pin a version range and note why "
     "the package is needed."),
    ("explain-shell-commands", "safety", "Before running a shell command that deletes, moves or "
     "overwrites files, say what it will do and to which paths."),
    ("summarize-long-logs", "communication", "When a log or traceback is long, quote only the "
     "lines that matter and summarize the rest."),
    ("cite-sources", "research", "When answering from documents or web pages, name the source "
     "of each claim so the user can check it."),
    ("calendar-invites", "scheduling", "When creating a meeting or calendar event, confirm the "
     "date, time zone, duration and attendees first."),
    ("email-drafts", "communication", "Draft emails with a clear subject, one purpose, and the "
     "requested action in the first paragraph."),
    ("sql-migrations", "data", "Change database schemas with forward-only migrations and back up "
     "the database before applying them."),
    ("csv-cleaning", "data", "When cleaning a CSV file, keep the raw file, log every dropped row "
     "and check column types after parsing."),
    ("secrets-hygiene", "safety", "Never print, log or commit API keys, tokens or passwords; read "
     "them from environment variables."),
    ("plan-multistep-tasks", "planning", "For tasks with several steps, write a short numbered "
     "plan first and update it as steps finish."),
]

TASKS = [
    "fix the failing unit test in the parser module",
    "edit the config file to change the server port",
    "summarize this long build log and tell me what broke",
    "schedule a meeting with the data team next Tuesday afternoon",
    "clean the sales CSV file and drop duplicate rows",
    "write an email to the client about the delayed release",
    "add a database migration for the new orders table",
    "delete the temporary files in the build folder",
    "return the results as JSON with name and score fields",
    "find out why the deploy script fails with a permission error",
    "add the requests package to the project dependencies",
    "refactor the payment function and make sure nothing breaks",
]
WORDS = ("quickly carefully today again please also then first finally maybe now later "
         "backend frontend staging production report notes draft").split()


def user_message(i: int) -> str:
    """A unique, realistic user request (unique so no retrieval cache can serve it)."""
    extra = " ".join(WORDS[(i * 7 + k * 3) % len(WORDS)] for k in range(4))
    return f"Task {i}: {TASKS[i % len(TASKS)]}, {extra}."


def request_body(i: int, stream: bool, protocol: str = "openai") -> dict:
    if protocol == "responses":
        return {"model": MODEL, "stream": stream, "instructions": SYSTEM,
                "input": [{"role": "user", "content": user_message(i)}]}
    if protocol == "anthropic":
        return {"model": MODEL, "stream": stream, "max_tokens": 256, "system": SYSTEM,
                "messages": [{"role": "user", "content": user_message(i)}]}
    return {"model": MODEL, "stream": stream,
            "messages": [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": user_message(i)}]}


# ---------------------------------------------------------------------------------------------
# processes
# ---------------------------------------------------------------------------------------------
def child_env() -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "PYTHONUNBUFFERED": "1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: The proxy of ``--baseline-tree``.
BASELINE = "proxy[lexical,baseline]"

def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (Linux /proc; 0.0 where unavailable)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def start_double(source: str | None = None) -> tuple[subprocess.Popen, str]:
    source = source or DOUBLE_PROCESS.format(model=MODEL)
    proc = subprocess.Popen([sys.executable, "-c", source],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env=child_env())
    line = proc.stdout.readline().strip()
    if not line.isdigit():
        proc.kill()
        raise RuntimeError(f"the upstream double did not start (it printed {line!r})")
    return proc, f"http://127.0.0.1:{int(line)}/v1"


def write_skills(folder: Path) -> int:
    """20 skills: the 8 bundled starter skills plus 12 more. Returns how many were written."""
    from metaclaw.skills.library import Skill, starter_skills_dir

    shutil.copytree(starter_skills_dir(), folder)
    for name, category, description in EXTRA_SKILLS:
        steps = "\n".join(f"{n}. {part.strip().capitalize()}." for n, part in
                          enumerate(description.rstrip(".").split(","), 1))
        body = (f"# {name.replace('-', ' ').capitalize()}\n\n{description}\n\n## How\n{steps}\n\n"
                "## Avoid\n- Skipping this because the task looks small.\n"
                "- Doing it silently: tell the user what you did.\n")
        (folder / name).mkdir()
        (folder / name / "SKILL.md").write_text(
            Skill(name=name, description=description, category=category, body=body).to_markdown())
    return sum(1 for p in folder.glob("*/SKILL.md"))


@dataclass
class ProxyProcess:
    name: str
    proc: subprocess.Popen
    url: str
    db: Path | str
    log: Path


def start_proxy(retrieval: str, upstream: str, workdir: Path, upstream_protocol: str = "openai",
                name: str | None = None, extra: tuple[str, ...] = (),
                launcher: tuple[str, ...] = ("-m", "metaclaw"),
                db: str | None = None) -> ProxyProcess:
    """``metaclaw serve`` in its own process; returns once ``/healthz`` answers. ``launcher``:
    what runs the CLI (the interpreter's arguments before ``serve``)."""
    workdir.mkdir(parents=True)
    skills = workdir / "skills"
    write_skills(skills)
    db, log, port = db or workdir / "bench.db", workdir / "proxy.log", free_port()
    command = [sys.executable, *launcher, "serve", "--upstream", upstream,
               "--retrieval", retrieval, "--skills", str(skills), "--db", str(db),
               "--port", str(port)]
    if upstream_protocol != "openai":
        command += ["--upstream-protocol", upstream_protocol]
    command += list(extra)
    with open(log, "wb") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=child_env())
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the {retrieval} proxy exited with status {proc.returncode}:\n"
                               + log.read_text(errors="replace")[-2000:])
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                return ProxyProcess(name or f"proxy[{retrieval}]", proc, f"http://127.0.0.1:{port}/v1",
                                    db, log)
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"the {retrieval} proxy did not answer /healthz within 180 s")


def start_passthrough(upstream: str, record: Path | None = None) -> ProxyProcess:
    """The floor (``benchmarks/passthrough.py``) in its own process, forwarding to ``upstream``;
    with ``record``, the recording floor committing each exchange to that database."""
    root = upstream[:-3] if upstream.endswith("/v1") else upstream
    command = [sys.executable, str(Path(__file__).with_name("passthrough.py")), "--upstream", root]
    if record is not None:
        command += ["--record", str(record)]
    proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env=child_env())
    line = proc.stdout.readline().strip()
    if not line.isdigit():
        proc.kill()
        raise RuntimeError(f"the pass-through did not start (it printed {line!r})")
    return ProxyProcess(FLOOR if record is None else RECORDING_FLOOR, proc,
                        f"http://127.0.0.1:{int(line)}/v1", record or Path(), Path())


def stop_proxy(proxy: ProxyProcess) -> int:
    """SIGTERM (the proxy records pending turns first); returns the turns in its store."""
    from metaclaw.store import Store

    proxy.proc.terminate()
    try:
        proxy.proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proxy.proc.kill()
        proxy.proc.wait()
    return int(Store(proxy.db).query("SELECT COUNT(*) AS n FROM turns")[0]["n"])


# ---------------------------------------------------------------------------------------------
# measuring
# ---------------------------------------------------------------------------------------------
@dataclass
class Samples:
    plain: list[float] = field(default_factory=list)      # non-streaming latency, ms
    ttfc: list[float] = field(default_factory=list)       # time to first stream chunk, ms
    stream: list[float] = field(default_factory=list)     # whole stream, ms
    injected: list[int] = field(default_factory=list)     # skills the proxy injected


class RequestFailed(RuntimeError):
    pass


def _check(response: httpx.Response, target: str) -> None:
    if response.status_code != 200:
        response.read()
        raise RequestFailed(f"{target} answered HTTP {response.status_code}: "
                            f"{response.text[:300]}")


def _injected(response: httpx.Response) -> int | None:
    names = response.headers.get("x-metaclaw-injected-skills")
    return None if names is None else len([n for n in names.split(",") if n])


def _path(target: str) -> str:
    return {"anthropic": "/messages", "responses": "/responses"}.get(
        PROTOCOL_OF.get(target, "openai"), "/chat/completions")


def _is_end(target: str, line: str) -> bool:
    protocol = PROTOCOL_OF.get(target)
    if protocol == "anthropic":
        return line.strip() == "event: message_stop"
    if protocol == "responses":
        return line.strip() == "event: response.completed"
    return line.strip() == "data: [DONE]"


def call_plain(client: httpx.Client, target: str, url: str, i: int) -> tuple[float, int | None]:
    started = time.perf_counter()
    protocol = PROTOCOL_OF.get(target, "openai")
    response = client.post(url + _path(target), json=request_body(i, False, protocol))
    _check(response, target)
    data = response.json()
    text = (data["content"][0]["text"] if protocol == "anthropic"
            else data["output"][0]["content"][0]["text"] if protocol == "responses"
            else data["choices"][0]["message"]["content"])
    if not text:
        raise RequestFailed(f"{target} returned an empty reply")
    return (time.perf_counter() - started) * 1000, _injected(response)


def call_stream(client: httpx.Client, target: str, url: str, i: int) -> tuple[float, float]:
    started = time.perf_counter()
    first, chunks, done = None, 0, False
    body = request_body(i, True, PROTOCOL_OF.get(target, "openai"))
    with client.stream("POST", url + _path(target), json=body) as response:
        _check(response, target)
        for line in response.iter_lines():
            if _is_end(target, line):
                done = True
            if not line.startswith("data:"):
                continue
            if first is None:
                first = time.perf_counter()
            if line[5:].strip() != "[DONE]":
                chunks += 1
    if first is None or not done or chunks < 2:
        raise RequestFailed(f"{target} sent an incomplete stream ({chunks} chunks, done={done})")
    end = time.perf_counter()
    return (first - started) * 1000, (end - started) * 1000


def run_sequential(clients: dict[str, httpx.Client], targets: dict[str, str], n: int,
                   seq: list[int]) -> dict[str, Samples]:
    """``n`` rounds of one non-streaming and one streaming request per target, one at a time;
    the target order rotates every round so drift falls on all targets alike."""
    names = list(targets)
    samples = {name: Samples() for name in names}
    for i in range(n):
        k = i % len(names)
        order = names[k:] + names[:k]
        message = seq[0]  # the stream gets message + 1: a query cache never serves it
        seq[0] += 2
        for name in order:
            latency, injected = call_plain(clients[name], name, targets[name], message)
            samples[name].plain.append(latency)
            if injected is not None:
                samples[name].injected.append(injected)
        for name in reversed(order):
            ttfc, total = call_stream(clients[name], name, targets[name], message + 1)
            samples[name].ttfc.append(ttfc)
            samples[name].stream.append(total)
    return samples


@dataclass
class Throughput:
    requests: int = 0
    seconds: float = 0.0
    latencies: list[float] = field(default_factory=list)

    @property
    def rate(self) -> float:
        return self.requests / self.seconds if self.seconds else 0.0


async def _batch(client: httpx.AsyncClient, target: str, url: str, first: int, count: int,
                 concurrency: int, stream: bool) -> tuple[float, list[float]]:
    """``count`` requests with ``concurrency`` in flight; returns (wall seconds, latencies ms)."""
    latencies: list[float] = []
    next_index = [first]

    async def one(i: int) -> None:
        started = time.perf_counter()
        body = request_body(i, stream, PROTOCOL_OF.get(target, "openai"))
        if stream:
            done = False
            async with client.stream("POST", url + _path(target), json=body) as response:
                if response.status_code != 200:
                    await response.aread()
                    _check(response, target)
                async for line in response.aiter_lines():
                    done = done or _is_end(target, line)
            if not done:
                raise RequestFailed(f"{target} sent an incomplete stream")
        else:
            response = await client.post(url + _path(target), json=body)
            _check(response, target)
            response.json()
        latencies.append((time.perf_counter() - started) * 1000)

    async def worker() -> None:
        while next_index[0] < first + count:
            i = next_index[0]
            next_index[0] += 1
            await one(i)

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return time.perf_counter() - started, latencies


async def run_concurrent(targets: dict[str, str], n: int, concurrency: int, rounds: int,
                         seq: list[int]) -> dict[tuple[str, bool], Throughput]:
    """``n`` requests per target and mode in ``rounds`` alternating batches, after a warm-up."""
    names = list(targets)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    clients = {name: httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(180.0))
               for name in names}
    results = {(name, stream): Throughput() for name in names for stream in (False, True)}
    try:
        for stream in (False, True):
            for name in names:  # warm-up: open the pool's connections
                await _batch(clients[name], name, targets[name], seq[0], 2 * concurrency,
                             concurrency, stream)
            seq[0] += 2 * concurrency
            sizes = [n // rounds + (1 if r < n % rounds else 0) for r in range(rounds)]
            for r, size in enumerate(sizes):
                k = r % len(names)
                for name in names[k:] + names[:k]:
                    seconds, latencies = await _batch(clients[name], name, targets[name], seq[0],
                                                      size, concurrency, stream)
                    result = results[(name, stream)]
                    result.requests += size
                    result.seconds += seconds
                    result.latencies += latencies
                seq[0] += size
    finally:
        for client in clients.values():
            await client.aclose()
    return results


# ---------------------------------------------------------------------------------------------
# reporting
# ---------------------------------------------------------------------------------------------
def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile ``q`` (0-100) of ``values``."""
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def stats(values: list[float]) -> list[float]:
    return [percentile(values, 50), percentile(values, 95), percentile(values, 99),
            sum(values) / len(values)]


def row(label: str, numbers: list[float], unit: str = "", width: int = 9) -> str:
    return f"  {label:<40}" + "".join(f"{x:>{width}.2f}" for x in numbers) \
        + (f"  {unit}" if unit else "")


def report_sequential(samples: dict[str, Samples], direct: str) -> list[str]:
    lines = []
    header = f"  {'':<40}{'p50':>9}{'p95':>9}{'p99':>9}{'mean':>9}"
    for title, attr in (("non-streaming request latency (ms)", "plain"),
                        ("streaming: time to first chunk (ms)", "ttfc"),
                        ("streaming: whole stream (ms)", "stream")):
        lines += ["", f"{title}, n={len(getattr(samples[direct], attr))} per target", header]
        base = stats(getattr(samples[direct], attr))
        lines.append(row(direct, base))
        for name, s in samples.items():
            if name == direct:
                continue
            mine = stats(getattr(s, attr))
            lines.append(row(name, mine))
            lines.append(row(f"added by {name}", [m - b for m, b in zip(mine, base)], "ms"))
            lines.append(row(f"ratio proxied/direct {name}", [m / b for m, b in zip(mine, base)],
                             "x"))
    return lines


def report_concurrent(results: dict[tuple[str, bool], Throughput], direct: str,
                      concurrency: int) -> list[str]:
    lines: list[str] = []
    for stream in (False, True):
        kind = "streaming" if stream else "non-streaming"
        base = results[(direct, stream)]
        lines += ["", f"concurrency {concurrency} (asyncio client), {kind}, "
                      f"n={base.requests} per target",
                  f"  {'':<40}{'req/s':>9}{'p50 ms':>9}{'p95 ms':>9}{'p99 ms':>9}"]
        for name in dict.fromkeys(n for n, _ in results):
            result = results[(name, stream)]
            lat = result.latencies
            lines.append(f"  {name:<40}{result.rate:>9.1f}{percentile(lat, 50):>9.2f}"
                         f"{percentile(lat, 95):>9.2f}{percentile(lat, 99):>9.2f}")
        for name in dict.fromkeys(n for n, _ in results):
            if name != direct:
                ratio = results[(name, stream)].rate / base.rate
                lines.append(f"  ratio proxied/direct throughput {name}: {ratio:.3f}x "
                             f"({kind}, concurrency {concurrency})")
    return lines


def report_targets(samples: dict[str, Samples], results: dict[tuple[str, bool], Throughput],
                   cpu_used: dict[str, float], direct: str, requests: int, concurrency: int,
                   failed: list[str]) -> list[str]:
    """The targets of CHECKED against the floors, as ratios with PASS / FAIL (failures are
    appended to ``failed``)."""
    lines = ["", f"targets: {CHECKED} (turn committed before the reply ends, every turn "
                 f"recorded) against the {FLOOR} (CPU: the {RECORDING_FLOOR}), side by side "
                 "in this run"]

    def verdict(name: str, ok: bool) -> str:
        if not ok:
            failed.append(name)
        return "PASS" if ok else "FAIL"

    for title, attr in (("added p50, non-streaming", "plain"),
                        ("added p50, time to first chunk", "ttfc")):
        base = percentile(getattr(samples[direct], attr), 50)
        mine = percentile(getattr(samples[CHECKED], attr), 50) - base
        floor = percentile(getattr(samples[FLOOR], attr), 50) - base
        ratio = mine / floor if floor > 0 else float("inf")
        lines.append(f"  {title:<36} proxy {mine:6.2f} ms / floor {floor:6.2f} ms = "
                     f"{ratio:6.2f}x  (target <= {MAX_ADDED_RATIO:g}x)  "
                     f"{verdict(title, ratio <= MAX_ADDED_RATIO)}")
    for stream in (False, True):
        title = f"throughput c={concurrency}, {'streaming' if stream else 'non-streaming'}"
        mine, floor = results[(CHECKED, stream)].rate, results[(FLOOR, stream)].rate
        ratio = mine / floor if floor else 0.0
        lines.append(f"  {title:<36} proxy {mine:6.1f}/s / floor {floor:6.1f}/s = {ratio:6.2f}x  "
                     f"(target >= {MIN_THROUGHPUT_RATIO:g}x)  "
                     f"{verdict(title, ratio >= MIN_THROUGHPUT_RATIO)}")
    title = f"CPU per request ({requests} requests)"
    mine, floor = (1000 * cpu_used[name] / requests for name in (CHECKED, RECORDING_FLOOR))
    ratio = mine / floor if floor else float("inf")
    note = "" if requests >= CPU_REQUESTS else f"; fewer than {CPU_REQUESTS} requests: indicative"
    lines.append(f"  {title:<36} proxy {mine:6.2f} ms / recording floor {floor:6.2f} ms = "
                 f"{ratio:6.2f}x  (target <= {MAX_CPU_RATIO:g}x{note})  "
                 f"{verdict(title, ratio <= MAX_CPU_RATIO)}")
    lines += ["", f"for reference (no target): {CHECKED}'s added p50 against the "
                  f"{RECORDING_FLOOR}'s, its CPU against the {FLOOR}'s"]
    base = percentile(samples[direct].plain, 50)
    mine, floor = (percentile(samples[name].plain, 50) - base
                   for name in (CHECKED, RECORDING_FLOOR))
    lines.append(f"  {'added p50, non-streaming':<36} proxy {mine:6.2f} ms / floor "
                 f"{floor:6.2f} ms = {mine / floor if floor > 0 else float('inf'):6.2f}x")
    mine, floor = (1000 * cpu_used[name] / requests for name in (CHECKED, FLOOR))
    lines.append(f"  {title:<36} proxy {mine:6.2f} ms / floor {floor:6.2f} ms = "
                 f"{mine / floor if floor else float('inf'):6.2f}x")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=500,
                        help="measured requests per target and mode (default 500: the CPU "
                             "ratio then covers over 2,000 requests per process)")
    parser.add_argument("--concurrency", type=int, default=16,
                        help="requests in flight in the throughput phase (default 16)")
    parser.add_argument("--embedding", action="store_true",
                        help="also measure a proxy with embedding retrieval")
    parser.add_argument("--warmup", type=int, default=None,
                        help="unmeasured warm-up requests per target (default requests/10, >= 5)")
    parser.add_argument("--rounds", type=int, default=4,
                        help="alternating batches per target in the concurrent phase (default 4)")
    parser.add_argument("--durable-acks", action="store_true",
                        help="also measure a lexical proxy that ends each reply before its turn "
                             "is committed (serve --no-durable-acks), beside the default durable "
                             "one: the cost of durability")
    parser.add_argument("--fsync-acks", action="store_true",
                        help="also measure a lexical proxy that fsyncs each commit before "
                             "acknowledging (serve --fsync-acks: turns survive power loss, not "
                             "only kill -9)")
    parser.add_argument("--protocols", default="openai,anthropic",
                        help="client protocols to measure, comma-separated: openai, anthropic, "
                             "responses (default openai,anthropic)")
    parser.add_argument("--db", help="also measure a proxy whose workspace is on PostgreSQL: "
                        "postgresql (a throwaway cluster) or postgresql://...")
    parser.add_argument("--baseline-tree", metavar="DIR",
                        help="also measure the proxy of another checkout (before a change)")
    parser.add_argument("--check-targets", action="store_true",
                        help="exit 1 when a target fails (against the floor, or PostgreSQL's)")
    args = parser.parse_args(argv)
    protocols = [p.strip() for p in args.protocols.split(",") if p.strip()]
    if not protocols or set(protocols) - {"openai", "anthropic", "responses"}:
        parser.error("--protocols takes openai, anthropic and/or responses")
    if "responses" in protocols and "openai" not in protocols:
        parser.error("--protocols responses is measured beside openai (its baseline): add it")
    for flag in ("requests", "concurrency", "rounds"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} must be at least 1")
    if args.warmup is not None and args.warmup < 0:
        parser.error("--warmup must be 0 or more")
    if args.rounds > args.requests:
        parser.error("--rounds must not exceed --requests")
    if args.baseline_tree and not (Path(args.baseline_tree) / "metaclaw" / "__init__.py").is_file():
        parser.error(f"--baseline-tree {args.baseline_tree}: no checkout of the project there "
                     "(no metaclaw/__init__.py); e.g. git worktree add /tmp/before <commit>")
    warmup = args.warmup if args.warmup is not None else max(5, args.requests // 10)

    double_proc, double_url = start_double()
    doubles = [double_proc]
    proxies: list[ProxyProcess] = []
    floors: list[ProxyProcess] = []  # the floor and the recording floor
    tmp = Path(tempfile.mkdtemp(prefix="metaclaw-bench-proxy-"))
    direct = "direct (upstream double)"
    cluster = None
    postgres = "proxy[lexical,postgresql]"
    groups: dict[str, list[str]] = {}  # the direct target of a group -> its targets
    try:
        targets: dict[str, str] = {}
        if "openai" in protocols:
            targets[direct] = double_url
            floors.append(start_passthrough(double_url))
            floors.append(start_passthrough(double_url, tmp / "recording-floor.db"))
            for p in floors:
                targets[p.name] = p.url
            for retrieval in ["lexical"] + (["embedding"] if args.embedding else []):
                proxies.append(start_proxy(retrieval, double_url, tmp / retrieval))
                targets[proxies[-1].name] = proxies[-1].url
            if args.durable_acks:
                proxies.append(start_proxy("lexical", double_url, tmp / "not-durable", "openai",
                                           "proxy[lexical,no-durable-acks]",
                                           ("--no-durable-acks",)))
                targets[proxies[-1].name] = proxies[-1].url
            if args.fsync_acks:
                proxies.append(start_proxy("lexical", double_url, tmp / "fsync", "openai",
                                           "proxy[lexical,fsync-acks]", ("--fsync-acks",)))
                targets[proxies[-1].name] = proxies[-1].url
            if args.db:
                url = args.db
                if url == "postgresql":
                    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
                    import pgcluster

                    cluster = pgcluster.start(fsync=True)
                    if cluster is None:
                        raise RuntimeError(f"no PostgreSQL: {'; '.join(pgcluster.WHY_NOT)}")
                    url = cluster.new_database("bench")
                proxies.append(start_proxy("lexical", double_url, tmp / "postgresql", "openai",
                                           postgres, db=url))
                targets[postgres] = proxies[-1].url
            if args.baseline_tree:
                tree = str(Path(args.baseline_tree).resolve())
                # that tree's package first, ahead of an editable install of this one and of
                # the working folder (which may be this checkout); the run says which it loaded
                launcher = ("-c", "import sys; sys.meta_path[:] = [f for f in sys.meta_path if "
                            "'editable' not in getattr(f, '__module__', '')]; "
                            "sys.path[:] = [p for p in sys.path if p not in ('', '.')]; "
                            f"sys.path.insert(0, {tree!r}); import metaclaw; "
                            f"assert metaclaw.__file__.startswith({tree!r}), metaclaw.__file__; "
                            "from metaclaw.cli import main; sys.exit(main())")
                proxies.append(start_proxy("lexical", double_url, tmp / "baseline", "openai",
                                           BASELINE, launcher=launcher))
                targets[BASELINE] = proxies[-1].url
            if "responses" in protocols:  # Responses clients, translated to the chat double
                name = "proxy[lexical] responses->openai"
                proxies.append(start_proxy("lexical", double_url, tmp / "responses", "openai",
                                           name))
                targets[name] = proxies[-1].url
                PROTOCOL_OF[name] = "responses"
            groups[direct] = list(targets)
        if "anthropic" in protocols:
            anthropic_proc, anthropic_url = start_double(ANTHROPIC_DOUBLE_PROCESS)
            doubles.append(anthropic_proc)
            direct_a = "direct anthropic (upstream double)"
            group = [direct_a]
            targets[direct_a] = anthropic_url
            for upstream, kind in ((anthropic_url[:-3], "anthropic"), (double_url, "openai")):
                name = f"proxy[lexical] anthropic->{kind}"
                proxies.append(start_proxy("lexical", upstream, tmp / f"anthropic-{kind}", kind,
                                           name))
                targets[name] = proxies[-1].url
                group.append(name)
            for name in group:
                PROTOCOL_OF[name] = "anthropic"
            groups[direct_a] = group
        load_before = os.getloadavg()
        print(f"MetaClaw proxy overhead: client httpx {httpx.__version__} in process {os.getpid()}, "
              f"upstream = offline doubles (scripted echo, no delay) in processes "
              f"{', '.join(str(d.pid) for d in doubles)}, "
              + ", ".join(f"{p.name} in process {p.proc.pid}"
                          for p in proxies + floors)
              + f"; 20 skills per proxy, top-k 3; {os.cpu_count()} CPUs; load average "
              + " ".join(f"{x:.2f}" for x in load_before), flush=True)

        seq = [0]
        clients = {name: httpx.Client(timeout=httpx.Timeout(180.0)) for name in targets}
        try:
            run_sequential(clients, targets, warmup, seq)  # not measured
            measured = proxies + floors
            cpu_start = {p.name: cpu_seconds(p.proc.pid) for p in measured}
            server_cpu = cluster_cpu(cluster)
            client_cpu = time.process_time()
            started = time.perf_counter()
            samples = run_sequential(clients, targets, args.requests, seq)
        finally:
            for client in clients.values():
                client.close()
        sequential_s = time.perf_counter() - started
        results = asyncio.run(run_concurrent(targets, args.requests, args.concurrency,
                                             args.rounds, seq))
        total_s = time.perf_counter() - started
        client_cpu = time.process_time() - client_cpu
        cpu_used = {p.name: cpu_seconds(p.proc.pid) - cpu_start[p.name] for p in measured}
        server_cpu = cluster_cpu(cluster) - server_cpu

        lines = [f"sequential phase {sequential_s:.1f} s (warm-up {warmup} per target), "
                 f"concurrent phase {total_s - sequential_s:.1f} s"]
        lines.append("(added = proxied percentile minus direct percentile; "
                     "ratio = proxied / direct)")
        for base, group in groups.items():
            if len(groups) > 1:
                lines += ["", f"== {PROTOCOL_OF.get(base, 'openai')} clients (baseline: {base})"]
            lines += report_sequential({n: samples[n] for n in group}, base)
            lines += report_concurrent({k: v for k, v in results.items() if k[0] in group}, base,
                                       args.concurrency)
        per_proxy = 4 * args.requests + 4 * args.concurrency  # measured + concurrent warm-up
        lines += ["", "proxy process cost"]
        sent = per_proxy + 2 * warmup
        for p in proxies:
            injected = samples[p.name].injected
            lines.append(f"  {p.name}: {1000 * cpu_used[p.name] / per_proxy:.2f} ms CPU per "
                         f"request (all phases, incl. recording), "
                         f"{sum(injected) / max(1, len(injected)):.2f} skills injected per request")
            health = httpx.get(p.url.removesuffix("/v1") + "/healthz", timeout=10).json()
            lines.append(f"    of which writing the turns to the store: "
                         f"{1000 * health['record_cpu_s'] / sent:.2f} ms CPU per turn "
                         f"({health['record_commits']} transactions for {sent} turns; the "
                         "proxy's own measure, thread CPU time)")
        for p in floors:
            lines.append(f"  {p.name}: {1000 * cpu_used[p.name] / per_proxy:.2f} ms CPU per "
                         "request (all phases)")
        lines.append(f"  client: {1000 * client_cpu / (per_proxy * len(targets)):.2f} ms CPU "
                     "per request")

        failed: list[str] = []

        def versus(name: str, base: str, title: str, target: float | None = None) -> None:
            """One line: ``name``'s added p50 and CPU per request against ``base``'s."""
            added = {n: statistics.median(samples[n].plain) - statistics.median(samples[direct].plain)
                     for n in (name, base)}
            cpu = {n: 1000 * cpu_used[n] / per_proxy for n in (name, base)}
            p50_ratio, cpu_ratio = added[name] / added[base], cpu[name] / cpu[base]
            met = target is None or max(p50_ratio, cpu_ratio) <= target
            verdict = "" if target is None else f"; target <= {target}x: {'PASS' if met else 'FAIL'}"
            if not met:
                failed.append(title)
            lines.extend(["", f"{title}: added p50 {added[name]:+.2f} vs {added[base]:+.2f} ms "
                          f"({p50_ratio:.2f}x), proxy CPU per request {cpu[name]:.2f} vs "
                          f"{cpu[base]:.2f} ms ({cpu_ratio:.2f}x){verdict}"])

        responses = "proxy[lexical] responses->openai"
        if responses in targets and CHECKED in targets:
            versus(responses, CHECKED, "Responses vs chat clients (same proxy code, same chat double)")
        if BASELINE in targets and CHECKED in targets:
            versus(CHECKED, BASELINE, f"this tree vs {args.baseline_tree} (same requests, one run)")
        if postgres in targets and CHECKED in targets:
            versus(postgres, CHECKED, "PostgreSQL vs SQLite workspace (same proxy code)", 1.5)
            if cluster is not None:
                lines.append(f"  the PostgreSQL server's own CPU: {1000 * server_cpu / per_proxy:.2f}"
                             " ms per request (all its processes, this run's requests)")
        if floors and CHECKED in targets:
            lines += report_targets(samples, results, cpu_used, direct, per_proxy,
                                    args.concurrency, failed)
        print("\n".join(lines), flush=True)

        for p in list(proxies):
            proxies.remove(p)
            recorded = stop_proxy(p)
            print(f"  {p.name} recorded {recorded} turns in its store (sent {sent})")
            if recorded != sent:
                print(f"error: {p.name} lost turns: {sent - recorded} of {sent} are not in "
                      f"{p.db}", file=sys.stderr)
                return 1
        for p in floors[1:]:  # the recording floor: what it committed (seen by a new connection)
            with contextlib.closing(sqlite3.connect(p.db)) as db:
                recorded = db.execute("SELECT COUNT(*) FROM exchanges").fetchone()[0]
            print(f"  {p.name} recorded {recorded} exchanges in its database (sent {sent})")
        load_after = os.getloadavg()
        print("load average at the end: " + " ".join(f"{x:.2f}" for x in load_after))
        if failed and args.check_targets:
            print(f"error: targets failed: {', '.join(failed)}", file=sys.stderr)
            return 1
        return 0
    except (RequestFailed, RuntimeError, httpx.HTTPError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        for p in proxies + floors:
            p.proc.terminate()
            try:
                p.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.proc.kill()
        for proc in doubles:
            proc.stdin.close()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
        shutil.rmtree(tmp, ignore_errors=True)
        if cluster is not None:
            cluster.remove()


def cluster_cpu(cluster) -> float:
    """CPU seconds used so far by the processes of a throwaway PostgreSQL cluster (0 without)."""
    if cluster is None:
        return 0.0
    total = 0.0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            if b"postgres" in cmdline and str(cluster.folder).encode() in cmdline or \
                    _parent_is_cluster(int(pid), cluster):
                total += cpu_seconds(int(pid))
        except (OSError, ValueError):
            continue
    return total


def _parent_is_cluster(pid: int, cluster) -> bool:
    """Whether ``pid`` is a backend of the cluster (its postmaster's child)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    parent = int(stat.rsplit(")", 1)[1].split()[1])
    try:
        return str(cluster.folder).encode() in Path(f"/proc/{parent}/cmdline").read_bytes()
    except OSError:
        return False


if __name__ == "__main__":
    sys.exit(main())
