"""A streaming client for any OpenAI-compatible server (vLLM, Ollama, MLC-LLM, trtllm-serve, llama-server ...).

Requests: `POST /v1/completions` (backend.api=completions: a text `prompt`) or `POST /v1/chat/completions`
(api=chat: one user message), `"stream": true` with `"stream_options": {"include_usage": true}`, `max_tokens`,
temperature 0, a fixed seed, `ignore_eos` (backend.ignore_eos; vLLM and llama-server honour it, others ignore it)
and backend.extra_body merged in. Definitions (controller clock, `time.perf_counter`):

- TTFT = arrival of the first chunk whose text (completions: `choices[0].text`; chat: `delta.content` or
  `delta.reasoning_content`) is not empty - the send moment; a chat stream's first role-only chunk is no token;
- e2e = arrival of `data: [DONE]` (or the stream's end) - the send moment;
- tokens = the server's own `usage` (`prompt_tokens`, `completion_tokens`) from the stream. A server that reports no
  usage is a failed request that says so: jbench never counts tokens by guessing from text or chunks;
- the gaps between tokens are the gaps between text chunks only when the server streamed one chunk per token
  (chunks == completion_tokens); otherwise a chunk holds several tokens and there are no per-token gaps.

Prompts are text, so their token count is the server's tokenizer's: `TextPrompts` writes ~N tokens of English from
a words-per-token ratio it learns from the server's `usage.prompt_tokens` (the warm-up requests teach it), and each
request's actual count is the server's. Each prompt starts with a tag of its own (a session's turns share theirs),
so no request hits another's prefix cache (vLLM caches prefixes by default).
"""

from __future__ import annotations

import http.client
import json
import math
import threading
import time
import uuid
import zlib
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Mapping, Optional

from jbench.backends.serving.http import ClientPool, EventStream, HTTPClient, RequestError
from jbench.backends.serving.workload import RequestSpec

# Cycled to write prompts of any length (plain words: about 1.3 tokens each for most English tokenizers; the ratio
# is learned from the server anyway).
WORDS = (
    "The history of computing is a story of measurement. Engineers who build small machines for robots, cameras and "
    "vehicles care about how quickly a model answers the first word of a question, how steadily the following words "
    "arrive, and how much energy each of them costs. A careful benchmark records the configuration, the software "
    "build, the exact model file and the raw output behind every number, so that a result can be reproduced months "
    "later on another board, under another power mode, by another person."
).split()

APIS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


@dataclass
class OpenAIRecord:
    """One streamed request as the client measured it. Times in seconds; token_times_s relative to sent_at."""

    index: int
    worker: int
    sent_at: float
    ttft_s: float
    e2e_s: float
    token_times_s: list[float]  # arrival of each chunk with text
    output_tokens: int  # usage.completion_tokens
    prompt_tokens: Optional[int]  # usage.prompt_tokens
    cached_tokens: Optional[int] = None  # usage.prompt_tokens_details.cached_tokens, where the server reports it
    requested_tokens: int = 0  # max_tokens sent
    prompt_words: int = 0  # words of the text prompt jbench wrote (0: the trace's own text)
    finish_reason: Optional[str] = None
    usage: dict = field(default_factory=dict)

    def token_gaps(self) -> tuple[float, ...]:
        if len(self.token_times_s) != self.output_tokens:
            return ()
        times = self.token_times_s
        return tuple(b - a for a, b in zip(times, times[1:]))

    def to_json(self) -> str:
        d = asdict(self)
        d.update(ttft_ms=self.ttft_s * 1000.0, e2e_ms=self.e2e_s * 1000.0)
        return json.dumps(d, sort_keys=True)


class TextPrompts:
    """Text prompts of about N tokens: words cycled from WORDS after a tag of the request's own, the number of words
    from a words-per-token ratio learned from the server's usage (thread-safe: workers report as they finish)."""

    INITIAL_TOKENS_PER_WORD = 1.3  # until the server has counted a prompt

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._words = 0
        self._tokens = 0

    @property
    def tokens_per_word(self) -> float:
        with self._lock:
            return self._tokens / self._words if self._words else self.INITIAL_TOKENS_PER_WORD

    def learn(self, words: int, prompt_tokens: Optional[int]) -> None:
        if words > 0 and prompt_tokens:
            with self._lock:
                self._words += words
                self._tokens += prompt_tokens

    def text(self, n_tokens: int, tag: int) -> tuple[str, int]:
        """(prompt, its word count) for about n_tokens tokens; `tag` makes it differ from the first word on."""
        n_words = max(1, round(n_tokens / self.tokens_per_word) - 2)  # the tag takes about two tokens
        start = tag % len(WORDS)
        body = [WORDS[(start + i) % len(WORDS)] for i in range(n_words)]
        return f"{tag:08x}: " + " ".join(body), n_words + 1


def request_body(api: str, model: Optional[str], prompt: str, max_tokens: int, *, seed: Optional[int],
                 ignore_eos: bool, extra: Mapping[str, Any]) -> dict:
    body: dict[str, Any] = {"max_tokens": max_tokens, "temperature": 0, "stream": True,
                            "stream_options": {"include_usage": True}}
    if model:
        body["model"] = model
    if api == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if seed is not None:
        body["seed"] = seed
    if ignore_eos:
        body["ignore_eos"] = True
    body.update(extra)
    return body


def read_stream(resp: Any, clock: Callable[[], float] = time.perf_counter) -> tuple[list[float], dict, Optional[str],
                                                                                     float]:
    """(arrival of each chunk with text, the last usage object, the finish reason, the end time) of an SSE stream."""
    token_times: list[float] = []
    usage: dict = {}
    finish: Optional[str] = None
    stream = EventStream(resp, clock)
    for now, obj in stream:
        for choice in obj.get("choices") or ():
            delta = choice.get("delta") or {}
            text = choice.get("text") or delta.get("content") or delta.get("reasoning_content")
            if text:
                token_times.append(now)
            if choice.get("finish_reason"):
                finish = choice["finish_reason"]
            break  # one choice per request (n=1)
        if isinstance(obj.get("usage"), dict):
            usage = obj["usage"]
    end = stream.end()
    return token_times, usage, finish, end


class OpenAIClient(HTTPClient):
    """One connection to the server (or the local end of the device's tunnel); one request at a time."""

    def __init__(self, address: tuple[str, int], timeout: float, headers: Optional[Mapping[str, str]] = None,
                 prime_path: Optional[str] = None):
        super().__init__(address, timeout)
        self.headers = dict(headers or {})
        self.prime_path = prime_path

    def get_json(self, path: str) -> Any:
        """GET path as JSON (HTTP errors and non-JSON answers raise RequestError)."""
        status, payload = self.exchange("GET", path, headers=self.headers)
        if status != 200:
            raise RequestError(f"GET {path} answered HTTP {status}: {payload[:300]!r}")
        try:
            return json.loads(payload)
        except ValueError:
            raise RequestError(f"GET {path} answered no JSON: {payload[:300]!r}") from None

    def _fresh(self) -> None:
        """A new connection, primed with GET prime_path when given (through an SSH tunnel the first request on a
        connection also opens its channel), so TTFT holds neither TCP nor a channel's setup. Servers close a
        connection after a streamed answer (llama-server does), so none is reused for the next request."""
        self.conn.close()
        self._connect()
        if self.prime_path:
            self.conn.request("GET", self.prime_path, headers=self.headers)
            resp = self.conn.getresponse()
            resp.read()
            if resp.will_close:  # an HTTP/1.0 server: the priming cannot be kept
                self.conn.close()
                self._connect()

    def stream(self, path: str, body: dict, *, index: int, worker: int) -> OpenAIRecord:
        """One streamed request on a fresh connection (_fresh), timed from the send to the stream's end."""
        data = json.dumps(body).encode()
        headers = {**self.headers, "Content-Type": "application/json", "Accept": "text/event-stream"}
        clock = time.perf_counter
        try:
            self._fresh()
            sent_at = clock()
            self.conn.request("POST", path, body=data, headers=headers)
            resp = self.conn.getresponse()
            if resp.status != 200:
                payload = resp.read()
                self.conn.close()
                raise RequestError(f"{path} answered HTTP {resp.status}: {payload[:500]!r}",
                                   "backend_crash" if resp.status >= 500 else "unparseable_output")
            token_times, usage, finish, end = read_stream(resp, clock)
            self.conn.close()
        except (OSError, http.client.HTTPException):
            self.conn.close()
            raise
        if not token_times:
            raise RequestError(f"request {index}: the stream carried no text")
        completion = usage.get("completion_tokens")
        if not isinstance(completion, int) or isinstance(completion, bool):
            raise RequestError(
                f"request {index}: the server reported no token usage in its stream (usage.completion_tokens), "
                "although the request asked for it (stream_options.include_usage); jbench counts tokens only from "
                "the server's usage, never from text: use a server version that reports usage when streaming")
        prompt = usage.get("prompt_tokens")
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") \
            if isinstance(usage.get("prompt_tokens_details"), dict) else None
        return OpenAIRecord(index=index, worker=worker, sent_at=sent_at, ttft_s=token_times[0] - sent_at,
                            e2e_s=end - sent_at, token_times_s=[t - sent_at for t in token_times],
                            output_tokens=completion, prompt_tokens=prompt if isinstance(prompt, int) else None,
                            cached_tokens=cached if isinstance(cached, int) else None,
                            requested_tokens=int(body.get("max_tokens") or 0), finish_reason=finish,
                            usage={k: v for k, v in usage.items() if isinstance(v, (int, float))})


class Sender:
    """The load generator's send(spec, worker) for an OpenAI-compatible server: a client per worker thread."""

    def __init__(self, address: tuple[str, int], *, api: str, model: Optional[str], seed: int, ignore_eos: bool,
                 extra_body: Mapping[str, Any], timeout_s: float, headers: Optional[Mapping[str, str]] = None,
                 prime_path: Optional[str] = None):
        self.address, self.api, self.model, self.seed = address, api, model, seed
        self.ignore_eos, self.extra_body, self.timeout_s = ignore_eos, dict(extra_body), timeout_s
        self.headers, self.prime_path = dict(headers or {}), prime_path
        self.prompts = TextPrompts()
        # Mixed into every prompt's tag: two trials against one server (a server left running, a search's repeat)
        # never send the same prompt, so neither reuses the other's prefix cache.
        self.nonce = uuid.uuid4().hex
        self._clients = ClientPool(lambda: OpenAIClient(self.address, self.timeout_s, self.headers, self.prime_path))
        self._lock = threading.Lock()  # the request counter behind each prompt's tag
        self._count = 0

    def _tag(self, spec: RequestSpec) -> int:
        if spec.session is not None:  # a session's turns share their first words (within this trial)
            return zlib.crc32(f"{self.nonce}:{spec.session}".encode())
        with self._lock:
            self._count += 1
            return zlib.crc32(f"{self.nonce}:{self._count}".encode())

    def __call__(self, spec: RequestSpec, worker: int) -> OpenAIRecord:
        if spec.text is not None:
            prompt, words = spec.text, 0
        else:
            prompt, words = self.prompts.text(spec.prefix_tokens + spec.input_tokens, self._tag(spec))
        body = request_body(self.api, self.model, prompt, spec.output_tokens, seed=self.seed,
                            ignore_eos=self.ignore_eos, extra=self.extra_body)
        record = self._clients.get(worker).stream(APIS[self.api], body, index=spec.index, worker=worker)
        record.prompt_words = words
        self.prompts.learn(words, record.prompt_tokens)
        return record

    def abort(self) -> None:
        self._clients.abort()

    def close(self) -> None:
        self._clients.close()


def served_models(address: tuple[str, int], timeout_s: float, headers: Optional[Mapping[str, str]] = None) -> list[str]:
    """The model ids the server lists at GET /v1/models (empty when it lists none or has no such route)."""
    client = OpenAIClient(address, timeout_s, headers)
    try:
        data = client.get_json("/v1/models")
    except (RequestError, OSError, http.client.HTTPException):
        return []
    finally:
        client.close()
    items = data.get("data") if isinstance(data, dict) else None
    return [str(m["id"]) for m in items or () if isinstance(m, dict) and m.get("id")]


def finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)
