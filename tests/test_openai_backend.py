"""The openai backend (any OpenAI-compatible server) without a real model: planning checks, the argv it starts on the
device, the stream parser, token counts from the server's usage only, and whole runs against the stub server
(tests/fixtures/stub_openai_server.py) started as a device command or already running at a URL. Against the real
llama-server: tests/test_serving.py."""

from __future__ import annotations

import io
import json
import logging
import sys
from pathlib import Path

import pytest

from jbench.backends.base import BackendError
from jbench.backends.openai.backend import OpenAIBackend, image_digest
from jbench.backends.openai.client import RequestError, Sender, TextPrompts, read_stream
from jbench.backends.serving.workload import RequestSpec
from jbench.device.connection import CommandResult
from jbench.device.local import LocalConnection
from jbench.sweeps.plan import plan

from .fixtures.stub_openai_server import StubServer

STUB = Path(__file__).resolve().parent / "fixtures" / "stub_openai_server.py"
SMALL = ["backend=openai", "serving.levels=[1,2]", "serving.requests_per_level=4", "serving.input.mean=24",
         "serving.output.mean=5", "serving.warmup_requests=2", "backend.ready_timeout_s=30"]
log = logging.getLogger("jbench.test.openai")


def stub_command(*args: str) -> str:
    items = [sys.executable, str(STUB), "--port", "'{port}'", "--slots", "'{slots}'", "--token-delay", "0.002", *args]
    return f"backend.command=[{','.join(items)}]"


def trial_of(*overrides: str):
    p = plan([*SMALL, *overrides], use_grid=False)
    assert not p.problems, p.problems
    return p.trials[0]


def problems(*overrides: str) -> str:
    return "\n".join(plan([*SMALL, *overrides], use_grid=False).problems)


def test_planning_names_each_problem_of_the_server_declaration():
    assert "declare how the server runs, exactly one of" in problems()
    both = problems(stub_command(), "backend.url=http://127.0.0.1:8000")
    assert "got backend.command, backend.url" in both
    assert "put {port} in backend.command" in problems("backend.command=[vllm,serve,m]")
    unknown = problems("backend.command=[vllm,serve,'{modle}',--port,'{port}']")
    assert "unknown placeholder(s) modle" in unknown and "model_path" in unknown
    assert "backend.api 'responses' is not valid. Valid: completions, chat" in problems(stub_command(),
                                                                                       "backend.api=responses")
    assert "give http://HOST:PORT" in problems("backend.url=https://example.org")
    assert "backend.scenario 'bench'" in problems(stub_command(), "backend.scenario=bench")
    assert "serving.levels: 0.0 is not a positive number" in problems(stub_command(), "serving.levels=[0]")
    # The port may come through the environment (Ollama's OLLAMA_HOST), a user's placeholder from backend.vars.
    assert problems("backend.command=[ollama,serve]", "+backend.env.OLLAMA_HOST='127.0.0.1:{port}'") == ""
    assert problems("backend.command=['{server}',--port,'{port}']", "+backend.vars.server=/opt/x") == ""


def test_the_device_argv_fills_placeholders_and_puts_the_environment_in_front():
    trial = trial_of("backend.command=['{server}',-m,'{model_path}',--port,'{port}',-np,'{slots}',-c,'{context}']",
                     "+backend.vars.server=/opt/llama/llama-server", "+backend.env.LLAMA_ARG_THREADS=1",
                     "serving.slots=3")
    backend = OpenAIBackend(trial.cfg.backend)
    assert backend.reads_model_file(trial)
    argv = backend.server_command(trial, "/models/m.gguf", 4242)
    assert argv == ["env", "LLAMA_ARG_THREADS=1", "/opt/llama/llama-server", "-m", "/models/m.gguf", "--port", "4242",
                    "-np", "3", "-c", "768"]  # (24 + 5 + 1 rounded up to 256) x 3 slots
    assert not OpenAIBackend(trial_of(stub_command()).cfg.backend).reads_model_file(trial_of(stub_command()))


def test_a_container_is_run_on_the_host_network_with_its_environment_and_arguments():
    trial = trial_of("backend.container.image=dustynv/vllm:r36.4.0",
                     "backend.container.args=[vllm,serve,Qwen/Qwen2.5-0.5B-Instruct,--port,'{port}']",
                     "backend.container.run_args=[--runtime,nvidia]", "+backend.env.HF_HUB_OFFLINE=1")
    argv = OpenAIBackend(trial.cfg.backend).server_command(trial, None, 8123, "jbench-abc")
    assert argv == ["docker", "run", "--rm", "--name", "jbench-abc", "--network", "host", "--runtime", "nvidia",
                    "-e", "HF_HUB_OFFLINE=1", "dustynv/vllm:r36.4.0", "vllm", "serve", "Qwen/Qwen2.5-0.5B-Instruct",
                    "--port", "8123"]


class _FakeConn:
    name = "fake"

    def __init__(self, result: CommandResult):
        self.result, self.argv = result, None

    def run(self, argv, **kw):
        self.argv = argv
        return self.result


def test_the_image_digest_is_the_engines_repository_digest_or_nothing():
    digest = "sha256:" + "ab" * 32
    out = f'["dustynv/vllm@{digest}"] sha256:{"cd" * 32}\n'
    conn = _FakeConn(CommandResult(["docker"], 0, out, "", 0.1))
    assert image_digest(conn, "docker", "dustynv/vllm:r36.4.0") == digest
    assert conn.argv[:3] == ["docker", "image", "inspect"] and conn.argv[-1] == "dustynv/vllm:r36.4.0"
    local_only = _FakeConn(CommandResult(["docker"], 0, f'[] sha256:{"cd" * 32}\n', "", 0.1))
    assert image_digest(local_only, "docker", "mine:dev") == "sha256:" + "cd" * 32  # a local build: its image id
    missing = _FakeConn(CommandResult(["docker"], 1, "", "Error: No such image: x", 0.1))
    assert image_digest(missing, "docker", "x") is None


def _stream(*lines: str) -> io.BytesIO:
    return io.BytesIO("".join(f"{line}\n\n" for line in lines).encode())


def test_the_stream_counts_text_chunks_and_keeps_the_last_usage():
    clock = iter(range(100)).__next__
    chat = _stream('data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}],"usage":null}',
                   'data: {"choices":[{"index":0,"delta":{"content":"Hel"},"finish_reason":null}],"usage":null}',
                   ': keep-alive',
                   'data: {"choices":[{"index":0,"delta":{"content":"lo"},"finish_reason":"length"}],"usage":null}',
                   'data: {"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":2,"total_tokens":9}}',
                   "data: [DONE]")
    times, usage, finish, end = read_stream(chat, lambda: float(clock()))
    assert len(times) == 2 and usage["completion_tokens"] == 2 and finish == "length" and end > times[-1]
    with pytest.raises(RequestError, match="server error in the stream"):
        read_stream(_stream('data: {"error":{"message":"overloaded"}}'))
    with pytest.raises(RequestError, match="unparseable stream chunk"):
        read_stream(_stream("data: {not json"))


def test_prompts_learn_the_servers_tokens_per_word():
    prompts = TextPrompts()
    text, words = prompts.text(130, tag=7)
    assert words == 99 and text.startswith("00000007: ")  # 130 / 1.3 - 2 words of body, and the tag
    prompts.learn(words, 200)  # the server counted 2 tokens a word
    assert prompts.tokens_per_word == pytest.approx(200 / 99)
    assert prompts.text(130, tag=8)[1] == round(130 / (200 / 99)) - 2 + 1
    assert prompts.text(50, tag=1)[0].split()[:2] != prompts.text(50, tag=2)[0].split()[:2]  # differ from the start


@pytest.mark.parametrize("api", ["completions", "chat"])
def test_the_sender_counts_tokens_from_usage_against_the_stub(api):
    with StubServer(slots=2, token_delay_s=0.001) as srv:
        send = Sender(srv.address, api=api, model="stub-model", seed=1, ignore_eos=True, extra_body={}, timeout_s=30)
        try:
            records = [send(RequestSpec(index=i, input_tokens=40, output_tokens=6), 0) for i in range(3)]
        finally:
            send.close()
    for r in records:
        assert r.output_tokens == 6 and r.requested_tokens == 6 and len(r.token_times_s) == 6
        assert r.prompt_tokens == r.prompt_words  # the stub counts a word a token
        assert len(r.token_gaps()) == 5 and 0 < r.ttft_s <= r.e2e_s
    # Learned from the first answer: one token a word, so the next prompts hold 40 words (tag included).
    assert [r.prompt_words for r in records[1:]] == [39, 39]


def test_a_server_that_reports_no_usage_is_a_failed_request_that_says_so():
    with StubServer(slots=1, token_delay_s=0.0, usage=False) as srv:
        send = Sender(srv.address, api="completions", model=None, seed=0, ignore_eos=True, extra_body={},
                      timeout_s=30)
        with pytest.raises(RequestError, match="reported no token usage"):
            send(RequestSpec(index=0, input_tokens=8, output_tokens=4), 0)
        send.close()


def test_a_chunk_of_several_tokens_gives_no_per_token_gaps():
    from jbench.backends.openai.client import OpenAIRecord

    r = OpenAIRecord(index=0, worker=0, sent_at=0.0, ttft_s=0.1, e2e_s=0.5, token_times_s=[0.1, 0.3, 0.5],
                     output_tokens=6, prompt_tokens=8)
    assert r.token_gaps() == ()


def test_a_run_against_a_started_stub_records_levels_windows_and_the_version():
    trial = trial_of(stub_command(), "backend.version_path=/version",
                     f"backend.version_command=[{sys.executable},--version]")
    result = OpenAIBackend(trial.cfg.backend).run(trial, LocalConnection(), log)
    assert [lv.load for lv in result.serving_levels] == [1.0, 2.0]
    assert all(o.error is None and o.output_tokens == 5 for lv in result.serving_levels for o in lv.outcomes)
    assert [w.output_tokens for w in result.load_windows] == [20, 20]
    assert result.build["server_version_api"] == '{"version": "stub-1.0"}'
    assert result.build["server_version"].startswith("Python 3")
    assert result.info["served_model"] == "stub-model" and result.info["server"] == "command"
    assert result.command[:2] == [sys.executable, str(STUB)] and "--port" in result.command
    assert result.raw_output.count('"output_tokens": 5') == 8  # every measured request, warm-up left out
    assert 5 < result.metrics["serving_server_peak_rss_mib"] < 500  # the stub's own Python process, read before its stop


def test_a_server_already_running_is_measured_and_left_running():
    with StubServer(slots=2, token_delay_s=0.001) as srv:
        host, port = srv.address
        trial = trial_of(f"backend.url=http://{host}:{port}", "backend.api=chat")
        result = OpenAIBackend(trial.cfg.backend).run(trial, LocalConnection(), log)
        assert [len(lv.outcomes) for lv in result.serving_levels] == [4, 4]
        assert result.info["server"] == "url" and result.command == []
        assert "serving_server_peak_rss_mib" not in result.metrics  # not a process jbench started
        assert srv.stats()["requests"] == 2 + 8  # warm-up and levels; still serving after the run
    unreachable = trial_of("backend.url=http://127.0.0.1:9", "backend.ready_timeout_s=1")
    with pytest.raises(BackendError, match="did not answer GET /health with 200 within 1 s"):
        OpenAIBackend(unreachable.cfg.backend).run(unreachable, LocalConnection(), log)


def test_a_server_that_wants_a_key_gets_it_from_the_controllers_environment(monkeypatch, caplog):
    """backend.api_key_env names a variable of the jbench process; its value goes only into the requests' header."""
    key = "sk-test-0123456789"
    monkeypatch.delenv("JBENCH_TEST_API_KEY", raising=False)
    assert "JBENCH_TEST_API_KEY: that environment variable is not set" in problems(
        stub_command(), "backend.api_key_env=JBENCH_TEST_API_KEY")
    assert "give the NAME of an environment variable" in problems(stub_command(), f"backend.api_key_env='{key}'")
    with StubServer(slots=2, token_delay_s=0.001, api_key=key) as srv:
        host, port = srv.address
        without = trial_of(f"backend.url=http://{host}:{port}")
        with pytest.raises(BackendError, match="HTTP 401"):
            OpenAIBackend(without.cfg.backend).run(without, LocalConnection(), log)
        monkeypatch.setenv("JBENCH_TEST_API_KEY", key)
        trial = trial_of(f"backend.url=http://{host}:{port}", "backend.api_key_env=JBENCH_TEST_API_KEY")
        assert not OpenAIBackend(trial.cfg.backend).validate(trial)
        with caplog.at_level(logging.DEBUG):
            result = OpenAIBackend(trial.cfg.backend).run(trial, LocalConnection(), log)
        assert [len(lv.outcomes) for lv in result.serving_levels] == [4, 4]
        assert result.info["served_model"] == "stub-model"  # /v1/models answered with the key too
        recorded = json.dumps([result.info, result.build, result.metrics, result.command], default=str)
        assert key not in recorded + result.raw_output + result.raw_stderr + caplog.text
        assert trial.cfg.backend.api_key_env == "JBENCH_TEST_API_KEY"  # the name is what the config holds


def test_a_server_without_usage_fails_the_trial_with_the_reason():
    trial = trial_of(stub_command("--no-usage"))
    with pytest.raises(BackendError) as err:
        OpenAIBackend(trial.cfg.backend).run(trial, LocalConnection(), log)
    assert err.value.category == "unparseable_output" and "reported no token usage" in str(err.value)


@pytest.mark.parametrize("preset, required", [("ollama", None), ("vllm", "hf_model"), ("mlc_llm", "mlc_model"),
                                              ("llama_server", None)])
def test_the_shipped_server_declarations_plan_and_name_what_they_need(preset, required):
    if required:
        assert f"backend.vars.{required} is empty" in problems(f"backend={preset}")
        trial = trial_of(f"backend={preset}", f"backend.vars.{required}=some/model")
    else:
        trial = trial_of(f"backend={preset}")
    argv = OpenAIBackend(trial.cfg.backend).server_command(trial, "/m.gguf", 5000)
    assert "5000" in " ".join(argv) and not any("{" in a for a in argv), argv
    if preset == "ollama":
        assert argv == ["env", "OLLAMA_HOST=127.0.0.1:5000", "OLLAMA_NUM_PARALLEL=2", "ollama", "serve"]  # slots: the most in flight
    if preset == "vllm":
        assert argv[:3] == ["vllm", "serve", "some/model"] and "--no-enable-prefix-caching" in argv


def test_a_secret_in_the_declaration_is_refused_before_it_is_recorded():
    text = problems(stub_command(), "+backend.env.HF_TOKEN=hf_abc")
    assert "backend.env.HF_TOKEN looks like a secret" in text and "hf_abc" not in text
    assert "the argument after --api-key" in problems("backend.command=[vllm,serve,m,--port,'{port}',--api-key,k]")
    assert problems("backend.container.image=x", "backend.container.args=[s,--port,'{port}']",
                    "backend.container.run_args=[--env-file,/home/me/hf.env]") == ""  # a file holding it: fine


def test_a_secret_as_flag_value_or_container_environment_is_refused_too():
    assert "--api-key=... looks like a secret" in problems("backend.command=[vllm,serve,m,--port,'{port}','--api-key=sk']")
    text = problems("backend.container.image=x", "backend.container.args=[s,--port,'{port}']",
                    "backend.container.run_args=[-e,'HF_TOKEN=hf_x']")
    assert "HF_TOKEN=... looks like a secret" in text and "hf_x" not in text


def test_two_trials_against_one_server_never_send_the_same_prompt():
    with StubServer(slots=1, token_delay_s=0.0) as srv:
        prompts = []
        for _ in range(2):  # two trials: two senders, the same specs
            send = Sender(srv.address, api="completions", model=None, seed=0, ignore_eos=True, extra_body={},
                          timeout_s=30)
            prompts.append(send.prompts.text(16, send._tag(RequestSpec(index=0, input_tokens=16, output_tokens=2)))[0])
            send.close()
    assert prompts[0] != prompts[1]


def test_a_serving_trial_that_ran_out_of_memory_does_not_skip_the_next_declaration():
    from jbench.sweeps.sweep import _oom_key, skipped

    trial = trial_of(stub_command())
    assert trial.context_tokens == 0  # load levels: no fixed context
    assert skipped(trial, "k", {}, [(_oom_key(trial), 0, "run-of-a-7b-server")]) is None
