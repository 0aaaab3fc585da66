"""Talk to `pdserve serve` over ZeroMQ with the Python client: one-shot, streamed, async."""
import asyncio
import sys

from pdserve import AsyncClient, Client

address = sys.argv[1] if len(sys.argv) > 1 else "tcp://127.0.0.1:5555"

with Client(address) as client:
    done = client.generate("The router sends the request to", max_tokens=16, temperature=0)
    print("one-shot:", repr(done.text), done.token_ids, done.finish_reason)
    print("streamed:", end=" ")
    for out in client.stream(messages=[{"role": "user", "content": "Hello!"}], max_tokens=16, temperature=0):
        print(out.text, end="", flush=True)
    print()


async def many() -> None:
    async with AsyncClient(address) as client:
        results = await asyncio.gather(*(client.generate(f"Request number {i}", max_tokens=8, temperature=0)
                                         for i in range(4)))
        for r in results:
            print("async:", repr(r.text))

asyncio.run(many())
