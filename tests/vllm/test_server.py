"""The plug-in behind vLLM's OpenAI-compatible server: a plain ``vllm serve`` with the plug-in's
``additional_config``, asked through the ``openai`` client, plainly and streamed, answers as the
same requests through :func:`kvevict.vllm.LLM`, and shuts down cleanly."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm")
openai = pytest.importorskip("openai")

from tests.vllm.conftest import ENGINE_ARGS, engine

pytestmark = pytest.mark.xdist_group("vllm-serve")  # under `make test`'s workers: one server, on one of them

SETTINGS = {"policy": "tova", "budget": 48, "interval": 8}
"""A decode-time policy that evicts several times within each answer below."""
NEW_TOKENS = 40
PROMPT = "Here is a list of the fruit I bought at the market this morning: " + ", ".join(
    ["apples", "pears", "plums", "figs", "grapes", "cherries", "lemons", "limes"] * 3
)
MESSAGES = [{"role": "user", "content": "Name three rivers of Europe and say where each one reaches the sea."}]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def server(smollm2_dir: Path, tmp_path_factory) -> Iterator[str]:
    """``vllm serve`` of the embedded SmolLM2 with the plug-in, on localhost; its base URL. It is
    stopped as a user stops it (SIGINT) and must exit cleanly."""
    port = free_port()
    flags = {key.replace("_", "-"): value for key, value in ENGINE_ARGS.items()}
    command = [str(Path(sys.executable).parent / "vllm"), "serve", str(smollm2_dir), "--port", str(port)]
    command += [f"--{key}={value}" for key, value in flags.items()]
    command += ["--no-enable-prefix-caching", "--no-enable-chunked-prefill"]
    command += ["--additional-config", json.dumps({"kvevict": SETTINGS})]
    log = tmp_path_factory.mktemp("server") / "vllm-serve.log"
    environment = {key: value for key, value in os.environ.items() if key != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    with open(log, "w") as output:
        process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, env=environment)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        assert process.poll() is None, f"vllm serve exited with {process.returncode}:\n{log.read_text()[-4000:]}"
        assert time.monotonic() < deadline, f"vllm serve did not start in 300 s:\n{log.read_text()[-4000:]}"
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                if response.status == 200:
                    break
        except OSError:
            time.sleep(1)
    yield f"{url}/v1"
    process.send_signal(signal.SIGINT)
    try:
        code = process.wait(timeout=120)
    except subprocess.TimeoutExpired:
        process.kill()
        pytest.fail(f"vllm serve did not stop within 120 s of SIGINT:\n{log.read_text()[-4000:]}")
    assert code == 0, f"vllm serve exited with {code}:\n{log.read_text()[-4000:]}"


@pytest.fixture(scope="module")
def reference(smollm2_dir: Path) -> dict[str, dict[str, str]]:
    """The same requests, greedy, through :func:`kvevict.vllm.LLM` in this process (``"evicting"``)
    and through vLLM alone (``"alone"``); they differ, so a server that ignored the plug-in would
    not match the first."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    answers = {}
    for name, settings in (("alone", {}), ("evicting", SETTINGS)):
        with engine(smollm2_dir, **settings) as llm:
            answers[name] = {
                "completion": llm.generate([PROMPT], params)[0].outputs[0].text,
                "chat": llm.chat([MESSAGES], params)[0].outputs[0].text,
            }
    assert all(answers["alone"][kind] != answers["evicting"][kind] for kind in ("completion", "chat"))
    return answers


def client(base_url: str):
    return openai.OpenAI(base_url=base_url, api_key="unused", timeout=300)


def model_name(base_url: str) -> str:
    return client(base_url).models.list().data[0].id


def test_completions_answer_as_the_engine_does_plain_and_streamed(
    server: str, reference: dict[str, dict[str, str]]
) -> None:
    asked = {"model": model_name(server), "prompt": PROMPT, "max_tokens": NEW_TOKENS, "temperature": 0.0}
    asked["extra_body"] = {"ignore_eos": True}
    plain = client(server).completions.create(**asked)
    streamed = "".join(chunk.choices[0].text for chunk in client(server).completions.create(**asked, stream=True))
    assert plain.usage.completion_tokens == NEW_TOKENS
    assert plain.choices[0].text == reference["evicting"]["completion"]
    assert streamed == reference["evicting"]["completion"]


def test_chat_completions_answer_as_the_engine_does_plain_and_streamed(
    server: str, reference: dict[str, dict[str, str]]
) -> None:
    asked = {"model": model_name(server), "messages": MESSAGES, "max_tokens": NEW_TOKENS, "temperature": 0.0}
    asked["extra_body"] = {"ignore_eos": True}
    plain = client(server).chat.completions.create(**asked)
    chunks = client(server).chat.completions.create(**asked, stream=True)
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert plain.choices[0].message.content == reference["evicting"]["chat"]
    assert streamed == reference["evicting"]["chat"]


def test_a_request_asks_for_no_eviction_and_one_for_another_policy_is_refused(server: str, reference) -> None:
    """Per-request settings go through the server's ``vllm_xargs`` as JSON text (they hold no nested dict)."""
    asked = {"model": model_name(server), "prompt": PROMPT, "max_tokens": NEW_TOKENS, "temperature": 0.0}
    full = {"ignore_eos": True, "vllm_xargs": {"kvevict": json.dumps({"policy": "full"})}}
    answer = client(server).completions.create(**asked, extra_body=full)
    assert answer.choices[0].text == reference["alone"]["completion"]
    other = {"ignore_eos": True, "vllm_xargs": {"kvevict": json.dumps({"policy": "h2o"})}}
    with pytest.raises(openai.BadRequestError, match="this engine evicts with 'tova': a request may ask for it"):
        client(server).completions.create(**asked, extra_body=other)
