"""Talk to `pdserve serve` with the official openai client."""
import sys

from openai import OpenAI

base_url = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8000/v1"
client = OpenAI(base_url=base_url, api_key="unused")
model = client.models.list().data[0].id
print(client.completions.create(model=model, prompt="Hello, my name is", max_tokens=16, temperature=0).choices[0].text)
stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "What is the capital of France?"}],
                                        max_tokens=16, temperature=0, stream=True)
for chunk in stream:
    if chunk.choices:
        print(chunk.choices[0].delta.content or "", end="", flush=True)
print()
