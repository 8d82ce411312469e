"""`vllm serve <export>` (vLLM's OpenAI server) on a cpu-target export, started by docs/serving.md's command as
written (only the port changed), on 127.0.0.1, stopped by its pid: the docs' chat request goes through the chat
template and returns `generate()`'s tokens; concurrent requests, more than the export's slots, each return their solo
tokens; a request over the export's length is refused by vLLM with HTTP 400."""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from .conftest import EXPORT, SEQUENCE_LENGTH, doc_command, environment, greedy, prompts

STARTUP_TIMEOUT = 900  # seconds: vLLM's imports and its engine process, on 2 shared cores
REQUEST_TIMEOUT = 300


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(work):
    """The docs' `vllm serve` command on a free loopback port; its base URL. Stopped by its pid (its process group:
    vLLM's engine runs in a child process)."""
    port = free_port()
    command = doc_command("vllm serve").replace("--port 8000", f"--port {port}")
    assert "--host 127.0.0.1" in command
    log = open(work / "vllm-serve.log", "w")
    process = subprocess.Popen(shlex.split(command), cwd=work, env=environment(), stdout=log, stderr=subprocess.STDOUT,
                               start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while True:
            assert process.poll() is None, f"vllm serve exited:\n{(work / 'vllm-serve.log').read_text()[-4000:]}"
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "vllm serve did not answer /health in time"
            time.sleep(2)
        yield url, port
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=30)
        log.close()


def post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"{}")


def complete(url: str, prompt: list[int], max_tokens: int, **options) -> list[int]:
    status, body = post(f"{url}/v1/completions", {"model": EXPORT, "prompt": prompt, "max_tokens": max_tokens,
                                                  "temperature": 0, "return_token_ids": True, **options})
    assert status == 200, body
    return body["choices"][0]["token_ids"]


def test_the_docs_chat_request_goes_through_the_chat_template(server, work, reference):
    url, port = server
    command = doc_command("curl").replace("127.0.0.1:8000", f"127.0.0.1:{port}")
    result = subprocess.run(["bash", "-c", command], cwd=work, capture_output=True, text=True, timeout=REQUEST_TIMEOUT)
    assert result.returncode == 0, result.stderr
    request = json.loads(shlex.split(command)[shlex.split(command).index("-d") + 1])
    assert json.loads(result.stdout)["choices"][0]["message"]["content"]
    # The same request, asking for the token ids: the prompt is the chat template's, the answer generate()'s.
    status, body = post(f"{url}/v1/chat/completions", {**request, "return_token_ids": True})
    assert status == 200, body
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(work / EXPORT)
    prompt = tokenizer.apply_chat_template(request["messages"], add_generation_prompt=True)
    assert body["prompt_token_ids"] == prompt
    assert body["choices"][0]["token_ids"] == greedy(reference, prompt, request["max_tokens"])
    assert json.loads(result.stdout)["choices"][0]["message"]["content"] == body["choices"][0]["message"]["content"]


def test_concurrent_requests_return_their_solo_tokens(server, reference):
    url, _ = server
    batch = prompts([3, 127, 128, 129, 60, 240], seed=2)  # 6 requests, 4 slots
    solo = complete(url, batch[2], 8)
    with ThreadPoolExecutor(len(batch)) as pool:
        together = list(pool.map(lambda p: complete(url, p, 8), batch))
    assert together[2] == solo
    assert together == [greedy(reference, p, 8) for p in batch]


def test_a_request_over_the_exports_length_is_refused_with_400(server):
    url, _ = server
    (long_prompt,) = prompts([SEQUENCE_LENGTH + 10], seed=3)
    status, body = post(f"{url}/v1/completions", {"model": EXPORT, "prompt": long_prompt, "max_tokens": 4})
    assert status == 400 and "maximum context length" in json.dumps(body), body
    (prompt,) = prompts([SEQUENCE_LENGTH - 4], seed=4)  # fits, but not with 10 new tokens
    status, body = post(f"{url}/v1/completions", {"model": EXPORT, "prompt": prompt, "max_tokens": 10})
    assert status == 400, body
    assert complete(url, prompt, 4)  # at the limit: served


def test_a_seeded_sampled_request_is_reproducible(server):
    url, _ = server
    (prompt,) = prompts([30], seed=5)
    sampled = [complete(url, prompt, 12, temperature=1.0, top_k=50, seed=s) for s in (77, 77, 78)]
    assert sampled[0] == sampled[1] != sampled[2]
