"""The engine of one process: scheduler, block manager, sequences, model runner, sampler,
the engine API (`LLMEngine`) and the offline `LLM`."""
