"""Any OpenAI-compatible server as a backend (serving scenario): vLLM, Ollama, MLC-LLM, trtllm-serve, TensorRT
Edge-LLM's server, llama-server itself (docs/serving.md, "Any OpenAI-compatible server").

The server is declared on the device in one of three ways (exactly one):

- `backend.command`: an argument-list template run on the device (through the same launcher, readiness poll and
  guaranteed stop as llama-server: jbench.backends.serving.process), with placeholders {port} (a free port jbench
  picks on the device), {host} (127.0.0.1), {model_path} (the trial's model file on the device), {model}
  (model.name), {quant}, {slots} and {context} (from the serving section), and backend.vars;
- `backend.container.image`: the same, as `docker run --rm --network host ... IMAGE ARGS` (podman with
  container.engine=podman); the image's digest is recorded and is the build's identity;
- `backend.url`: a server already running, as the device sees it (http://127.0.0.1:11434): jbench checks its health,
  measures, and leaves it running.

The levels are jbench.backends.serving.levels' (the same load generator, windows and analysis as llama.cpp's serving
scenario); requests and token counts are jbench.backends.openai.client's (the server's usage, never a guess).
"""

from __future__ import annotations

import http.client
import logging
import os
import re
import string
import uuid
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional
from urllib.parse import urlsplit

from jbench.backends.base import Backend, BackendError, Capabilities, device_model_path
from jbench.backends.openai.client import APIS, Sender, served_models
from jbench.backends.serving import levels
from jbench.backends.serving.process import DeviceServer, http_get, request_failures, with_env
from jbench.core.results import BackendResult
from jbench.core.trial import Trial
from jbench.device.connection import Connection, DeviceError

PLACEHOLDERS = ("port", "host", "model_path", "model", "quant", "slots", "context")
ENGINES = ("docker", "podman")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_IMAGE_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
# Names of settings that hold a secret: jbench records the declaration with every run (params, the command tag, the
# log), so a secret is refused at plan time and belongs in the device's own environment instead.
_SECRET_ENV = re.compile(r"(^|_)(TOKEN|SECRET|PASSWORD|PASSWD|API_?KEY|CREDENTIALS?)($|_)", re.I)
_SECRET_FLAG = re.compile(r"^--?(?:[a-z0-9]+[-_])*(?:api[-_]?key|token|secret|password|passwd)$", re.I)


@dataclass
class ContainerConfig:
    """The server as a container on the device: `<engine> run --rm --name jbench-... --network host <run_args>
    -e K=V... <image> <args>`; args and run_args take the command's placeholders."""

    image: Optional[str] = field(default=None, metadata={"identity": True})
    args: List[str] = field(default_factory=list, metadata={"identity": True})
    # Before the image, e.g. [--runtime, nvidia] on a Jetson, or volume mounts for the model cache.
    run_args: List[str] = field(default_factory=list, metadata={"identity": True})
    engine: str = field(default="docker", metadata={"identity": False})


@dataclass
class OpenAIConfig:
    """An OpenAI-compatible server, measured with load levels (backend.scenario=serving)."""

    name: str = field(default="openai", metadata={"identity": True})
    # The one scenario: load levels against the server (the `serving` section).
    scenario: str = field(default="serving", metadata={"identity": True})
    # How the server starts on the device: an argv template (placeholders: PLACEHOLDERS and vars) ...
    command: List[str] = field(default_factory=list, metadata={"identity": True})
    # ... or a container ...
    container: ContainerConfig = field(default_factory=ContainerConfig, metadata={"identity": True})
    # ... or a server already running, as the device reaches it (http://127.0.0.1:11434).
    url: Optional[str] = field(default=None, metadata={"identity": False})
    # Environment of the server (command or container), values with placeholders: OLLAMA_HOST=127.0.0.1:{port}.
    env: Dict[str, str] = field(default_factory=dict, metadata={"identity": True})
    # More placeholders of your own: name -> value.
    vars: Dict[str, str] = field(default_factory=dict, metadata={"identity": True})
    # GET this path until it answers 200: ready (vLLM, trtllm-serve, llama-server: /health; Ollama: /; MLC-LLM:
    # /v1/models).
    health_path: str = field(default="/health", metadata={"identity": False})
    # completions: POST /v1/completions with a text prompt; chat: POST /v1/chat/completions with one user message.
    api: str = field(default="completions", metadata={"identity": True})
    # The `model` of each request; None: the first id the server lists at GET /v1/models.
    served_model: Optional[str] = field(default=None, metadata={"identity": True})
    # Ask for exactly max_tokens tokens (vLLM, llama-server honour `ignore_eos`; a server that ignores it may stop
    # early: the record has the server's own count).
    ignore_eos: bool = field(default=True, metadata={"identity": True})
    # Merged into every request body, e.g. {min_tokens: 128} (vLLM) or {options: {num_ctx: 4096}} (Ollama).
    extra_body: Dict[str, Any] = field(default_factory=dict, metadata={"identity": True})
    # The server's version, recorded with the run: a command on the device (argv with the command's placeholders,
    # e.g. [vllm, --version]) ...
    version_command: List[str] = field(default_factory=list, metadata={"identity": False})
    # ... and/or a path on the server (vLLM: /version; Ollama: /api/version).
    version_path: Optional[str] = field(default=None, metadata={"identity": False})
    ready_timeout_s: float = field(default=600.0, metadata={"identity": False})
    timeout_s: float = field(default=600.0, metadata={"identity": False})
    # A server that wants a key (vLLM's --api-key, a gateway): the NAME of an environment variable of the jbench
    # process whose value is sent as `Authorization: Bearer ...`. Only the name is recorded; the value never is.
    api_key_env: Optional[str] = field(default=None, metadata={"identity": False})


class ContainerServer(DeviceServer):
    """A DeviceServer whose process is `<engine> run`; stopping it also removes the container by name (the engine's
    client forwards SIGTERM to it, and `rm -f` catches a container the client left behind)."""

    MEASURES_RSS = False  # the pid is the engine's client, not the server
    def __init__(self, conn: Connection, argv_for_port, *, engine: str, container_name: str, **kw: Any):
        super().__init__(conn, argv_for_port, **kw)
        self.engine, self.container_name = engine, container_name

    def stop(self) -> None:
        if self._stopped:
            return
        try:
            super().stop()
        finally:
            try:
                self.conn.run([self.engine, "rm", "-f", self.container_name], timeout=60)
            except DeviceError as exc:
                self.log.warning("%s rm -f %s failed: %s", self.engine, self.container_name, exc)


class RunningServer:
    """A server already running at a URL the device reaches: health checked, never started or stopped by jbench."""

    def __init__(self, conn: Connection, url: str, *, health_path: str, ready_timeout_s: float, log: logging.Logger):
        parts = urlsplit(url)
        self.conn, self.url, self.health_path, self.log = conn, url, health_path, log
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.ready_timeout_s = ready_timeout_s
        self.argv: Optional[list[str]] = None
        self.address: Optional[tuple[str, int]] = None
        self.peak_rss_kib: Optional[int] = None  # not ours to read
        self._forwarder: Any = None

    def start(self) -> None:
        import time

        self._forwarder = self.conn.forward_port(self.port, self.host)
        self.address = self._forwarder.address
        deadline = time.monotonic() + self.ready_timeout_s
        last = "no answer"
        while time.monotonic() < deadline:
            try:
                status, body = http_get(self.address, self.health_path, timeout=5.0)
                if status == 200:
                    return
                last = f"HTTP {status} {body.strip()[:200]}"
            except (OSError, http.client.HTTPException) as exc:
                last = f"{type(exc).__name__}: {exc}"
            time.sleep(0.5)
        raise BackendError("timeout", f"the server at {self.url} did not answer GET {self.health_path} with 200 within "
                           f"{self.ready_timeout_s:g} s (last: {last})")

    def log_text(self) -> str:
        return ""  # not ours: its log is wherever it was started

    def stop(self) -> None:
        if self._forwarder is not None:
            self._forwarder.close()
            self._forwarder = None


def _fields(template: str) -> list[str]:
    return [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]


class OpenAIBackend(Backend[OpenAIConfig]):
    NAME = "openai"
    CAPABILITIES = Capabilities(kv_types=frozenset())
    CONFIG = OpenAIConfig

    # ---- planning

    def _templates(self, cfg: OpenAIConfig) -> list[str]:
        return [*cfg.command, *cfg.container.args, *cfg.container.run_args, *cfg.env.values()]

    def validate(self, trial: Trial) -> list[str]:
        cfg = self.config_of(trial)
        problems: list[str] = []
        if cfg.scenario != "serving":
            problems.append(f"backend.scenario '{cfg.scenario}': the openai backend measures load levels; use "
                            "backend.scenario=serving (one level of concurrency 1 is the latency of one user)")
        ways = [w for w, given in (("backend.command", bool(cfg.command)), ("backend.container.image",
                                                                          bool(cfg.container.image)),
                                   ("backend.url", bool(cfg.url))) if given]
        if len(ways) != 1:
            problems.append("declare how the server runs, exactly one of: backend.command (an argv template run on "
                            "the device), backend.container.image, or backend.url (a server already running)"
                            + (f"; got {', '.join(ways)}" if ways else ""))
        if cfg.api not in APIS:
            problems.append(f"backend.api '{cfg.api}' is not valid. Valid: {', '.join(APIS)}")
        if cfg.container.engine not in ENGINES:
            problems.append(f"backend.container.engine '{cfg.container.engine}' is not valid. Valid: "
                            f"{', '.join(ENGINES)}")
        known = set(PLACEHOLDERS) | set(cfg.vars)
        for item in [*self._templates(cfg), *cfg.version_command]:
            try:
                unknown = [f for f in _fields(str(item)) if f not in known]
            except ValueError as exc:
                problems.append(f"backend template item {item!r}: {exc} (write a literal brace as {{{{ or }}}})")
                continue
            if unknown:
                problems.append(f"backend template item {item!r}: unknown placeholder(s) {', '.join(unknown)}. "
                                f"Known: {', '.join(sorted(known))}")
        used = {f for i in [*self._templates(cfg), *cfg.version_command] for f in _safe_fields(str(i))}
        for name in sorted(used & set(cfg.vars)):
            if not str(cfg.vars[name] or "").strip():
                problems.append(f"backend.vars.{name} is empty and the server's command uses {{{name}}}: set it, "
                                f"e.g. backend.vars.{name}=...")
        if cfg.api_key_env is not None:
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", cfg.api_key_env):
                problems.append(f"backend.api_key_env '{cfg.api_key_env}': give the NAME of an environment variable "
                                "(e.g. VLLM_API_KEY), never the key itself")
            elif not os.environ.get(cfg.api_key_env):
                problems.append(f"backend.api_key_env={cfg.api_key_env}: that environment variable is not set (or "
                                "empty) in this shell; export it before the sweep")
        secret = [f"backend.env.{k}" for k in cfg.env if _SECRET_ENV.search(str(k))]
        items = [*cfg.command, *cfg.container.args, *cfg.container.run_args]
        secret += [f"the argument after {a}" for a, _ in zip(items, items[1:]) if _SECRET_FLAG.match(str(a))]
        for item in map(str, items):
            flag, eq, _ = item.partition("=")
            if eq and _SECRET_FLAG.match(flag):  # --api-key=VALUE
                secret.append(f"{flag}=...")
            elif eq and not flag.startswith("-") and _SECRET_ENV.search(flag):  # -e HF_TOKEN=VALUE (a container's)
                secret.append(f"{flag}=...")
        if secret:
            problems.append(f"{', '.join(secret)} looks like a secret, and jbench records the server's declaration with "
                            "every run: set it in the device's environment instead (the server inherits it), or give "
                            "a container --env-file PATH")
        for name in cfg.env:
            if not _ENV_NAME.fullmatch(str(name)):
                problems.append(f"backend.env: {name!r} is not an environment variable name")
        if (cfg.command or cfg.container.image) and not any("port" in _safe_fields(str(i))
                                                           for i in self._templates(cfg)):
            problems.append("the server must listen on the port jbench picks on the device: put {port} in "
                            "backend.command or container.args (e.g. --port {port}), or in backend.env "
                            "(e.g. OLLAMA_HOST: 127.0.0.1:{port})")
        if cfg.url:
            parts = urlsplit(cfg.url)
            if parts.scheme != "http" or not parts.hostname:
                problems.append(f"backend.url {cfg.url!r}: give http://HOST:PORT as the device reaches the server "
                                "(https is not supported)")
        if not cfg.health_path.startswith("/"):
            problems.append(f"backend.health_path {cfg.health_path!r} must start with /")
        if cfg.version_path is not None and not cfg.version_path.startswith("/"):
            problems.append(f"backend.version_path {cfg.version_path!r} must start with /")
        problems += levels.validate(trial.cfg.serving)
        return problems

    def reads_model_file(self, trial: Trial) -> bool:
        return any("model_path" in _safe_fields(str(i)) for i in self._templates(self.config_of(trial)))

    def _program(self) -> Optional[str]:
        """The executable the device runs (the container engine, or the command's first item with backend.vars
        filled in); None when there is none or it needs a per-trial placeholder."""
        cfg = self.config
        if cfg.container.image:
            return cfg.container.engine
        if not cfg.command:
            return None
        try:
            return str(cfg.command[0]).format(**{k: str(v) for k, v in cfg.vars.items()})
        except (KeyError, IndexError, ValueError):
            return None

    def preflight(self, conn: Connection) -> list[str]:
        program = self._program()
        if not program:
            return []  # a server already running, or a program named per trial: it shows when it runs
        if "/" in program:
            path = conn.expand_path(program)
            return [] if conn.exists(path) else [f"{path} not found on device '{conn.name}': fix backend.command"]
        res = conn.run(["sh", "-c", 'command -v "$1"', "sh", program], timeout=30)
        if res.returncode != 0 or not res.stdout.strip():
            return [f"'{program}' is not on the PATH of device '{conn.name}': install it there or give its path"]
        return []

    def build_id(self, conn: Connection) -> Optional[str]:
        """The container image's digest, else the SHA-256 of the server's executable; None for a running server."""
        cfg = self.config
        if cfg.container.image:
            return image_digest(conn, cfg.container.engine, cfg.container.image)
        program = self._program()
        if not program:
            return None
        from jbench.models.digest import file_digest

        path = conn.expand_path(program) if "/" in program else conn.run(
            ["sh", "-c", 'command -v "$1"', "sh", program], timeout=30).stdout.strip()
        digest = file_digest(path, conn) if path else None
        return f"sha256:{digest}" if digest else None

    # ---- running

    def values(self, trial: Trial, model_path: Optional[str], port: int) -> dict[str, str]:
        serving = trial.cfg.serving
        slots = levels.server_slots(serving)
        return {**{k: str(v) for k, v in self.config_of(trial).vars.items()}, "port": str(port), "host": "127.0.0.1",
                "model_path": model_path or "", "model": str(trial.cfg.model.name or ""),
                "quant": str(trial.cfg.model.quant or ""), "slots": str(slots),
                "context": str(levels.context_size(serving, slots))}

    def server_command(self, trial: Trial, model_path: Optional[str], port: int, container_name: str = "") -> list[str]:
        """The argv started on the device for this port (placeholders filled, environment as `env K=V`)."""
        cfg = self.config_of(trial)
        values = self.values(trial, model_path, port)
        fill = lambda items: [str(i).format(**values) for i in items]  # noqa: E731
        env = {k: str(v).format(**values) for k, v in cfg.env.items()}
        if cfg.container.image:
            argv = [cfg.container.engine, "run", "--rm", "--name", container_name, "--network", "host",
                    *fill(cfg.container.run_args)]
            for k, v in env.items():
                argv += ["-e", f"{k}={v}"]
            return [*argv, cfg.container.image, *fill(cfg.container.args)]
        return with_env(fill(cfg.command), env)

    def run(self, trial: Trial, conn: Connection, log: logging.Logger, *, only_phase: Optional[str] = None,
            repetitions: Optional[int] = None) -> BackendResult:
        cfg, load = self.config_of(trial), trial.cfg.serving
        if only_phase:
            log.info("serving scenario: only_phase=%s ignored, the whole scenario runs", only_phase)
        model_path = device_model_path(trial, conn) if self.reads_model_file(trial) else None
        build: dict[str, str] = {}
        if cfg.url:
            server: Any = RunningServer(conn, cfg.url, health_path=cfg.health_path,
                                        ready_timeout_s=cfg.ready_timeout_s, log=log)
        elif cfg.container.image:
            name = f"jbench-{uuid.uuid4().hex[:12]}"
            digest = image_digest(conn, cfg.container.engine, cfg.container.image)
            build.update(image=cfg.container.image, **({"image_digest": digest} if digest else {}))
            server = ContainerServer(conn, lambda port: self.server_command(trial, model_path, port, name),
                                     engine=cfg.container.engine, container_name=name,
                                     ready_timeout_s=cfg.ready_timeout_s, log=log, name=cfg.container.image,
                                     health_path=cfg.health_path)
        else:
            server = DeviceServer(conn, lambda port: self.server_command(trial, model_path, port),
                                  ready_timeout_s=cfg.ready_timeout_s, log=log, name=(self._program() or "server").split("/")[-1],
                                  health_path=cfg.health_path)
        if cfg.version_command:
            values = self.values(trial, model_path, 0)
            build.update(server_version=command_version(conn, [str(a).format(**values) for a in cfg.version_command]))
        sender: Optional[Sender] = None
        try:
            with request_failures(server):
                server.start()
                headers = auth_headers(cfg)
                models = served_models(server.address, cfg.timeout_s, headers)
                model = cfg.served_model or (models[0] if models else None)
                log.info("server ready; it serves %s; requests name %s", ", ".join(models) or "no model list",
                         model or "no model")
                if cfg.version_path:
                    build.update(server_version_api=path_version(server.address, cfg.version_path))
                sender = Sender(server.address, api=cfg.api, model=model, seed=load.seed, ignore_eos=cfg.ignore_eos,
                                extra_body=cfg.extra_body, timeout_s=cfg.timeout_s, prime_path=cfg.health_path,
                                headers=headers)
                levels.warm_up(load, sender)
                run = levels.run_levels(conn, load, sender, sender.abort, log=log, server_log=server.log_text)
        finally:
            if sender is not None:
                sender.abort()
                sender.close()
            server.stop()
        info = {"scenario": "serving", "api": cfg.api, "served_model": model, "served_models": models,
                "server": "url" if cfg.url else "container" if cfg.container.image else "command",
                "prompt_tokens_per_word": sender.prompts.tokens_per_word}
        metrics = {"serving_clock_uncertainty_ms": 1000 * run.clock.uncertainty_s} if run.clock else {}
        if server.peak_rss_kib is not None:
            metrics["serving_server_peak_rss_mib"] = server.peak_rss_kib / 1024
        return BackendResult(raw_output=run.records_jsonl, raw_stderr=server.log_text(), build=build, info=info,
                             command=list(server.argv or []), metrics=metrics, load_windows=run.windows,
                             serving_levels=run.levels, stepped=levels.overhead_series(run.overhead))


def _safe_fields(template: str) -> list[str]:
    try:
        return _fields(template)
    except ValueError:
        return []


def image_digest(conn: Connection, engine: str, image: str) -> Optional[str]:
    """The image's repository digest (sha256:...) as the device's container engine has it, else its image id;
    None when the engine does not know the image (it is pulled on first run, and recorded the next time)."""
    try:
        res = conn.run([engine, "image", "inspect", "--format", "{{json .RepoDigests}} {{.Id}}", image], timeout=60)
    except DeviceError:
        return None
    if res.returncode != 0:
        return None
    found = _IMAGE_DIGEST.findall(res.stdout)
    return found[0] if found else None


def command_version(conn: Connection, argv: List[str]) -> str:
    """The first line a version command prints on the device (stdout, else stderr); the exit code when it failed."""
    try:
        res = conn.run([str(a) for a in argv], timeout=60)
    except DeviceError as exc:
        return f"unknown ({exc})"
    text = (res.stdout.strip() or res.stderr.strip()).splitlines()
    if res.returncode != 0:
        return f"unknown ({argv[0]} exited {res.returncode})"
    return text[0][:200] if text else "unknown (no output)"


def auth_headers(cfg: OpenAIConfig) -> dict[str, str]:
    """`Authorization: Bearer <key>` from the controller's environment variable `backend.api_key_env` (validated at
    plan time); no header without one. The value lives only in the requests' headers."""
    key = os.environ.get(cfg.api_key_env) if cfg.api_key_env else None
    return {"Authorization": f"Bearer {key}"} if key else {}


def path_version(address: tuple[str, int], path: str) -> str:
    """The body of GET path (e.g. vLLM's /version, Ollama's /api/version), one line."""
    try:
        status, body = http_get(address, path, timeout=10.0)
    except (OSError, http.client.HTTPException) as exc:
        return f"unknown ({type(exc).__name__})"
    return " ".join(body.split())[:200] if status == 200 else f"unknown (HTTP {status})"
