"""Getting a model onto disk and into memory: safetensors weights, the embedded default
model, GGUF conversion and `pdserve make-model`."""
