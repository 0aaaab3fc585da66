"""What every benchmark shares: where the repository and its results are (`paths`), the
models they run (`models`), the servers they start (`servers`: pdserve and vLLM's CPU build),
the traces they replay (`traces`), the facts of a run (`facts`: chip, flags, threads, commit,
load), timing a phase on a shared machine (`timing`), the memory bandwidth bound
(`bandwidth`), a peer in a child process of another venv (`child`: llama.cpp) and writing a
report (`output`: JSON, plots)."""
