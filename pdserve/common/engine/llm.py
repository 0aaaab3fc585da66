"""The offline API: `LLM(model_dir, **options).generate(prompts, sampling_params)`."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from pdserve.common.config import EngineConfig
from pdserve.common.engine.engine import LLMEngine, RequestError
from pdserve.common.logprobs import TokenLogprobs
from pdserve.common.sampling_params import SamplingParams
from pdserve.common.text.detokenizer import IncrementalDetokenizer


class LLM:
    """An in-process engine on a model folder (or a .gguf file). Options are the engine
    options by their flat names (`EngineOptions.options()`: block_size, num_kv_blocks,
    max_model_len, dtype, device, ...), as `EngineConfig.build` takes them."""

    def __init__(self, model_dir: str | Path, **options: Any) -> None:
        if str(model_dir).lower().endswith(".gguf"):  # converted once into pdserve's cache
            from pdserve.common.loading.default_model import resolve_model_dir
            model_dir = resolve_model_dir(str(model_dir))
        self.engine = LLMEngine(EngineConfig.build(model_dir, **options))
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts: str | list[int] | list[str | list[int]],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[dict[str, Any]]:
        """One result dict per prompt, in order: text, token_ids, prompt_token_ids,
        finish_reason, num_cached_tokens; `logprobs` (a `TokenLogprobs` per output token)
        and `prompt_logprobs` (one per prompt token, the first None) when its params ask.
        With n > 1, `outputs` holds such a dict per choice (index order) and the top level
        is choice 0's (prompt logprobs: choice 0's only)."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # a single prompt
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise RequestError(f"got {len(sampling_params)} sampling params for {len(prompts)} prompts")
        # Validate everything before queueing anything, so bad input changes nothing.
        parents = [self.engine.new_sequence(p, sp) for p, sp in zip(prompts, sampling_params)]
        for seq in parents:
            self.engine.add(seq)
        choices = [[s, *s.forks] for s in parents]  # the forks leave `s.forks` once forked
        seqs = [c for cs in choices for c in cs]
        # stop strings are matched on the text, as the router does: one detokenizer per
        # sequence that has them, fed after each step; the others are decoded once at the end
        detoks = {s.seq_id: IncrementalDetokenizer.for_request(self.tokenizer, s.sampling_params)
                  for s in seqs if s.sampling_params.stop}
        bar = tqdm(total=len(seqs), desc="generate", disable=not use_tqdm, dynamic_ncols=True)
        errors: dict[int, str] = {}  # seq_id -> why the engine failed it (finish_reason "error")
        logprobs: dict[int, list[TokenLogprobs]] = {s.seq_id: [] for s in seqs if s.sampling_params.logprobs is not None}
        prompt_logprobs: dict[int, list[TokenLogprobs | None] | None] = {}
        try:
            while self.engine.has_work():
                outputs = self.engine.step()
                errors.update({o.seq.seq_id: o.error for o in outputs if o.error})
                done = 0
                for o in outputs:
                    detok = detoks.get(o.seq.seq_id)
                    if detok is not None and detok.stopped:
                        continue  # a token after its stop string (a speculative step kept several)
                    done += o.finished
                    if o.logprobs is not None:
                        logprobs[o.seq.seq_id].append(o.logprobs)
                    if o.prompt_logprobs is not None:
                        prompt_logprobs[o.seq.seq_id] = o.prompt_logprobs
                    if detok is None or o.error or o.new_token < 0:
                        continue
                    detok.add([o.new_token], o.finished)
                    if detok.stopped:
                        if not o.finished:
                            done += 1
                            self.engine.release(o.seq, "stop")
                            del o.seq.token_ids[o.seq.num_prompt_tokens + len(detok.token_ids):]  # none after the stop
                        o.seq.finish_reason = "stop"  # also when the same token reached max_tokens
                bar.update(done)
        except BaseException:
            for seq in seqs:
                self.engine.abort(seq)
            raise
        finally:
            bar.close()

        def result(s: Any) -> dict[str, Any]:
            text = detoks[s.seq_id].text if s.seq_id in detoks \
                else self.tokenizer.decode(s.output_token_ids, s.sampling_params.skip_special_tokens)
            return {"text": text, "token_ids": s.output_token_ids, "prompt_token_ids": s.token_ids[:s.num_prompt_tokens],
                    "finish_reason": s.finish_reason, "num_cached_tokens": s.num_cached_tokens,
                    **({"error": errors[s.seq_id]} if s.seq_id in errors else {}),
                    **({"logprobs": logprobs[s.seq_id]} if s.seq_id in logprobs else {}),
                    **({"prompt_logprobs": prompt_logprobs.get(s.seq_id)}
                       if s.sampling_params.prompt_logprobs is not None else {})}

        return [{**result(cs[0]), "outputs": [result(c) for c in cs]} if len(cs) > 1 else result(cs[0])
                for cs in choices]
