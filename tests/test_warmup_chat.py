"""The start-up warm-up's chat request (``engine_host.warmup.warm_chat_path``), against a
stand-in HTTP server (the real engine's warm-up is checked in tests/test_engine_host.py)."""

from __future__ import annotations

import asyncio
import json
import types

import httpx
import pytest

from engine_host import warmup


def _client(status: int, seen: list[dict]) -> httpx.AsyncClient:
    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(
            {
                "path": request.url.path,
                "body": json.loads(request.content),
                "auth": request.headers.get("authorization"),
            }
        )
        if status != 200:
            return httpx.Response(status, json={"error": {"message": "no chat template"}})
        chunks = [
            {"choices": [{"delta": {"role": "assistant", "content": ""}}]},
            {"choices": [{"delta": {"content": "Hi"}}]},
            {"choices": [], "usage": {"completion_tokens": 4}},
        ]
        text = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        return httpx.Response(200, text=text, headers={"content-type": "text/event-stream"})

    return httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://engine")


ARGS = types.SimpleNamespace(model="m", served_model_name=None, api_key=None, host="127.0.0.1", port=8000)


def test_the_chat_path_is_warmed_and_recorded():
    seen: list[dict] = []
    before = warmup.RUNS.since(0)
    last = before[-1]["id"] if before else 0

    async def go() -> bool:
        async with _client(200, seen) as client:
            return await warmup.warm_chat_path(client, ARGS, 4)

    assert asyncio.run(go()) is True
    assert seen[0]["path"] == "/v1/chat/completions"
    assert seen[0]["body"]["messages"][0]["role"] == "user" and "prompt" not in seen[0]["body"]
    # sampled with a seed, as chat traffic often is: the sampler's random path is used before a user's request
    assert seen[0]["body"]["temperature"] == warmup.CHAT_WARMUP_TEMPERATURE > 0 and seen[0]["body"]["seed"] == 0
    run = warmup.RUNS.since(last)[-1]
    assert run["detail"] == "chat" and run["k"] == 4 and run["outcome"] == "ok"
    assert run["output_tokens"] == 4 and run["ttft_s"] is not None


def test_a_model_without_a_chat_template_is_skipped_and_another_error_is_raised():
    before = warmup.RUNS.since(0)
    last = before[-1]["id"] if before else 0

    async def go(status: int) -> bool:
        async with _client(status, []) as client:
            return await warmup.warm_chat_path(client, ARGS, None)

    assert asyncio.run(go(400)) is False
    assert warmup.RUNS.since(last) == []
    with pytest.raises(httpx.HTTPStatusError):
        asyncio.run(go(500))


def test_the_first_token_is_the_first_chunk_with_text():
    """A chat stream's first chunk carries the role and empty content: not a token yet."""
    role = json.dumps({"choices": [{"delta": {"role": "assistant", "content": ""}}]})
    token = json.dumps({"choices": [{"delta": {"content": "Hi"}}]})
    usage = json.dumps({"choices": [], "usage": {"completion_tokens": 4}})
    assert not warmup._has_text(role, chat=True)
    assert warmup._has_text(token, chat=True)
    assert not warmup._has_text(usage, chat=True)
    assert warmup._has_text(json.dumps({"choices": [{"text": "Hi"}]}), chat=False)


def test_warm_up_requests_carry_the_api_key_the_launcher_hands_over_by_environment(monkeypatch):
    """The launcher gives vLLM the OpenAI API key as $VLLM_API_KEY, not --api-key: the warm-up
    (and every heartbeat) must send it, or a keyed engine host never becomes ready (401)."""
    seen: list[dict] = []

    async def go(args) -> bool:
        async with _client(200, seen) as client:
            return await warmup.warm_chat_path(client, args, 4)

    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    assert asyncio.run(go(ARGS)) is True and seen[-1]["auth"] is None  # an open API: no header
    monkeypatch.setenv("VLLM_API_KEY", "sk-from-env")
    assert asyncio.run(go(ARGS)) is True and seen[-1]["auth"] == "Bearer sk-from-env"
    on_cli = types.SimpleNamespace(**{**vars(ARGS), "api_key": ["sk-from-cli"]})
    assert asyncio.run(go(on_cli)) is True and seen[-1]["auth"] == "Bearer sk-from-cli"  # as vLLM: --api-key first
