"""The official openai SDK (sync and async, stream and not) against the simulator."""
from __future__ import annotations

import asyncio

import openai
import pytest


def test_sync_client(sim):
    with openai.OpenAI(base_url=sim.base_url + "/v1", api_key="none", max_retries=0) as client:
        models = client.models.list()
        assert [m.id for m in models.data] == ["motor-sim"]
        c = client.completions.create(model="motor-sim", prompt="hello", max_tokens=5)
        assert len(c.choices[0].text) == 5 and c.usage.completion_tokens == 5
        chat = client.chat.completions.create(
            model="motor-sim", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        assert chat.choices[0].message.role == "assistant"
        assert len(chat.choices[0].message.content) == 4 and chat.usage.prompt_tokens == 21
        text = ""
        usage = None
        for chunk in client.chat.completions.create(
                model="motor-sim", messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                stream=True, stream_options={"include_usage": True}):
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
            if chunk.usage:
                usage = chunk.usage
        assert len(text) == 6 and usage is not None and usage.completion_tokens == 6
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="other", prompt="x", max_tokens=1)


def test_async_client(sim):
    async def main():
        client = openai.AsyncOpenAI(base_url=sim.base_url + "/v1", api_key="none", max_retries=0)
        try:
            c = await client.completions.create(model="motor-sim", prompt="hello", max_tokens=3, n=2)
            assert [ch.index for ch in c.choices] == [0, 1]
            parts = []
            stream = await client.completions.create(model="motor-sim", prompt="hello",
                                                     max_tokens=4, stream=True)
            async for chunk in stream:
                parts.append(chunk.choices[0].text)
            assert len("".join(parts)) == 4
            chat_text = ""
            stream = await client.chat.completions.create(
                model="motor-sim", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                stream=True)
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    chat_text += chunk.choices[0].delta.content
            assert len(chat_text) == 3
            with pytest.raises(openai.BadRequestError):
                await client.completions.create(model="motor-sim", prompt="x", max_tokens=-1)
        finally:
            await client.close()
    asyncio.run(main())
