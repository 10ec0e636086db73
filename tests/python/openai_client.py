"""Drives a running tokenrouter server with the official `openai` client.

Usage: python3 openai_client.py BASE_URL
Exits non-zero (with the failed assertion) if any response is not what an OpenAI-compatible
server must return.
"""
import sys

import openai


def main(base_url: str) -> None:
    client = openai.OpenAI(base_url=base_url, api_key="unused")
    models = client.models.list()
    assert models.data[0].id == "tokenrouter", models

    chat = client.chat.completions.create(
        model="tokenrouter",
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=8,
        temperature=0,
    )
    choice = chat.choices[0]
    assert choice.message.role == "assistant", chat
    assert isinstance(choice.message.content, str), chat
    assert choice.finish_reason in ("stop", "length"), chat
    assert chat.usage.completion_tokens >= 1, chat
    assert chat.usage.total_tokens == chat.usage.prompt_tokens + chat.usage.completion_tokens
    assert chat.model_extra["routing"]["handoffs"] >= 0, chat

    pieces, finish, usage = [], None, None
    for chunk in client.chat.completions.create(
        model="tokenrouter",
        messages=[{"role": "user", "content": "Count to three."}],
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    ):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            pieces.append(c.delta.content or "")
            finish = c.finish_reason or finish
    assert finish == "length", finish
    assert usage is not None and usage.completion_tokens == 8, usage

    completion = client.completions.create(
        model="tokenrouter", prompt="def add(a, b):", max_tokens=6, temperature=0
    )
    assert completion.choices[0].finish_reason in ("stop", "length"), completion
    assert completion.usage.completion_tokens >= 1, completion

    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model="tokenrouter", prompt="def add(a, b):", max_tokens=6, temperature=0, stream=True
        )
        if c.choices
    )
    assert streamed == completion.choices[0].text, (streamed, completion.choices[0].text)

    try:
        client.chat.completions.create(
            model="tokenrouter", messages=[{"role": "user", "content": "x"}], temperature=-1
        )
        raise AssertionError("a negative temperature was accepted")
    except openai.BadRequestError as e:
        assert "temperature" in str(e), e
    print("openai client: all checks passed")


if __name__ == "__main__":
    main(sys.argv[1])
