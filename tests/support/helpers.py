"""Shared test helpers: the transformers oracle and prompt builders."""
from __future__ import annotations

import contextlib
import random

ARCHS = ("qwen3", "qwen2", "llama")  # every architecture pdserve loads; tiny models of each per session


def hf_reference_cache():
    """A memoized transformers greedy `generate`, one model load per directory."""
    import torch
    from transformers import AutoModelForCausalLM

    models: dict[str, object] = {}
    results: dict[tuple, list[int]] = {}

    def generate(model_dir: str, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        key = (model_dir, tuple(prompt_ids), max_new_tokens)
        if key not in results:
            if model_dir not in models:
                models[model_dir] = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
            model = models[model_dir]
            with torch.no_grad():
                out = model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                                     max_new_tokens=max_new_tokens, do_sample=False)
            results[key] = out[0, len(prompt_ids):].tolist()
        return results[key]

    return generate


def mixed_prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    """16+ prompts of mixed lengths: some cross block boundaries (block 16), some are long
    enough to be chunked by a small token budget, and some share long prefixes."""
    rng = random.Random(seed)
    ids = lambda n: [rng.randrange(3, vocab) for _ in range(n)]  # noqa: E731  (0-2 are special)
    lengths = [1, 5, 15, 16, 17, 31, 33, 47, 64, 65, 100, 129, 150, 200]
    prompts = [ids(n) for n in lengths]
    base = ids(70)
    prompts += [base + ids(9), base + ids(30), base[:48] + ids(5), base[:32]]
    return prompts


@contextlib.contextmanager
def one_torch_thread():
    """Run torch on one intra-op thread, then restore the old count. On 2 shared cores,
    a second thread next to worker processes (or other jobs) makes steps >10x slower."""
    import torch
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(old)


THINKING_TEMPLATE = (  # the make-model template plus Qwen3's `enable_thinking` switch
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\n\n</think>\n\n' }}{% endif %}"
    "{% endif %}"
)


def bos_thinking_model(src: str, dst) -> str:
    """A copy of model folder `src` whose tokenizer adds a BOS (`<|endoftext|>`) as a
    Llama-3 tokenizer does (tokenizer.json's post-processor) and whose chat template
    reads `enable_thinking`: what makes add_special_tokens and chat_template_kwargs show."""
    import json
    import shutil
    from pathlib import Path

    from tokenizers import Tokenizer, processors

    dst = Path(dst)
    shutil.copytree(src, dst)
    tok = Tokenizer.from_file(str(dst / "tokenizer.json"))
    bos = "<|endoftext|>"
    tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                       special_tokens=[(bos, tok.token_to_id(bos))])
    tok.save(str(dst / "tokenizer.json"))
    cfg = json.loads((dst / "tokenizer_config.json").read_text())
    cfg.update(bos_token=bos, chat_template=THINKING_TEMPLATE)
    (dst / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
    return str(dst)
