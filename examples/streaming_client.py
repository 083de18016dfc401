"""Stream from a running `pagedkv serve` with the openai client: chat, then a plain completion.

    pagedkv serve "$(python -m pagedkv.testing.real_model)" --served-model-name smollm2 &
    python examples/streaming_client.py [--url http://127.0.0.1:8000/v1] [--model smollm2]

Tokens print as they arrive (Server-Sent Events); the last chunk carries the usage, including
how many prompt tokens the prefix cache served.
"""

from __future__ import annotations

import argparse

from openai import OpenAI


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--model", default="smollm2", help="the server's --served-model-name")
    parser.add_argument("--api-key", default="unused", help="the server's --api-key, if any")
    args = parser.parse_args()
    client = OpenAI(base_url=args.url, api_key=args.api_key)

    stream = client.chat.completions.create(
        model=args.model, max_tokens=64, stream=True, stream_options={"include_usage": True},
        messages=[{"role": "user", "content": "Tell me a two-sentence story about a robot."}])
    for chunk in stream:
        if chunk.choices:
            print(chunk.choices[0].delta.content or "", end="", flush=True)
        elif chunk.usage:
            cached = getattr(chunk.usage.prompt_tokens_details, "cached_tokens", 0)
            print(f"\n[{chunk.usage.prompt_tokens} prompt tokens ({cached} cached), "
                  f"{chunk.usage.completion_tokens} generated]")

    for chunk in client.completions.create(model=args.model, prompt="The three primary colours are",
                                           max_tokens=24, stream=True):
        print(chunk.choices[0].text, end="", flush=True)
    print()


if __name__ == "__main__":
    main()
