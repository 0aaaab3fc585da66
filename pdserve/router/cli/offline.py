"""`pdserve make-model`, `convert-gguf` and `generate` (offline): no router, no workers.
`generate` exits 1 when any prompt ends in an error, after printing its cause."""
from __future__ import annotations

import argparse
import json
import sys
import time

from pdserve.common.loading.default_model import resolve_model
from pdserve.common.quantization import kept_linears
from pdserve.router.cli.flags import engine_options


def cmd_convert_gguf(args: argparse.Namespace) -> int:
    from pdserve.common.loading.gguf_convert import convert_gguf
    out = convert_gguf(args.gguf, args.out_dir)
    print(f"wrote {out} (float32 safetensors, config, tokenizer, chat template) from {args.gguf}")
    return 0


def cmd_make_model(args: argparse.Namespace) -> int:
    from pdserve.common.loading.model_factory import make_model
    t0 = time.perf_counter()
    out = make_model(args.dir, args.arch, args.size, args.seed, chat_template=args.chat_template)
    arch = json.loads((out / "config.json").read_text())["model_type"]  # --arch None: the size's family
    print(f"wrote {arch}/{args.size} model (seed {args.seed}) to {out} in {time.perf_counter() - t0:.1f} s")
    return 0


CHAT_PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.",
                "Give me two tips for writing clear code.", "What does a GPU do, in one sentence?"]


PLAIN_PROMPTS = ["The router sends the request to", "A prefill worker computes",
                 "Hello, my name is", "Decode workers stream tokens"]


def cmd_generate(args: argparse.Namespace) -> int:
    from pdserve.common import LLM, SamplingParams
    from pdserve.common.engine.model_runner import decide_num_blocks
    options = engine_options(args)  # the flags' values are checked before a model is fetched
    model = resolve_model(args.model)
    # the default model is an instruct model: by default each prompt is a user's chat turn
    chat = args.chat if args.chat is not None else args.model is None
    prompts = args.prompt or (CHAT_PROMPTS if chat else PLAIN_PROMPTS)
    if options.cache.num_kv_blocks is None:
        # A KV cache as large as the job can fill (each prompt's sequence up to max_model_len),
        # not `memory_fraction` of the host: the cache's pages are faulted in at start-up
        # (kernels/huge_pages.py), 5.5 s for the 4.8 GB default on 24 GiB; the default job
        # (4 prompts, 1024 blocks) took 18.5 s from a cold process without this, 12.5 s with
        # it, and 5.5 s once the repacked GGUF linears were cached (loading/gguf_quant.py).
        config = options.engine_config(model)
        per_sequence = -(-config.scheduler.max_model_len // config.cache.block_size)
        options = options.replace(num_kv_blocks=min(decide_num_blocks(config, config.speculative is not None),
                                                    len(prompts) * per_sequence))
    llm = LLM(model, **options.to_dict())
    inputs = [llm.tokenizer.encode(llm.tokenizer.apply_chat_template([{"role": "user", "content": p}]))
              for p in prompts] if chat else prompts
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens, seed=args.seed, ignore_eos=args.ignore_eos)
    t0 = time.perf_counter()
    outs = llm.generate(inputs, params)
    dt = time.perf_counter() - t0
    for prompt, out in zip(prompts, outs):
        if args.json:
            print(json.dumps({"prompt": prompt, **out}))
        else:
            print(f"{prompt!r} -> {out['text']!r}  [{len(out['token_ids'])} tokens, {out['finish_reason']}]")
    ntok = sum(len(o["token_ids"]) for o in outs)
    dev = llm.engine.config.device  # the precision it ran in: `auto` resolved, and how many linears each kind
    kept = " + ".join(f"{len(ws)} {kind}" for kind, ws in kept_linears(llm.engine.runner.model).items())
    print(f"model {model} ({dev.dtype}, quantization {dev.quantization}{f': {kept} linears' if kept else ''}): "
          f"{len(outs)} prompts, {ntok} tokens in {dt:.2f} s", file=sys.stderr)
    failed = [(prompt, out["error"]) for prompt, out in zip(prompts, outs) if out.get("error")]
    if failed:  # an answer that is an error is a failed job
        print(f"pdserve generate: {len(failed)} of {len(outs)} prompts failed; the first ({failed[0][0]!r}): "
              f"{failed[0][1]}", file=sys.stderr)
        return 1
    return 0
