"""The OpenAI-compatible HTTP front end: request bodies and their SamplingParams, the server, the error edge, response envelopes, chat output, logprobs, tools."""
