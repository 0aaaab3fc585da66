"""Runs the model on a scheduled batch: builds the flat inputs (input_ids, positions,
slot_mapping, block tables), calls the forward pass and samples. Owns the model, the
paged KV cache tensor and per-request sampling generators."""
from __future__ import annotations

import dataclasses
import itertools
import os
from typing import Callable

import numpy as np
import torch

from pdserve.common.models.attention import AttentionMetadata, PrefillMetadata
from pdserve.common.config import ConfigError, EngineConfig, ModelConfig
from pdserve.common.engine.kv_layout import kv_cache_tensor
from pdserve.common.malloc_tuning import keep_freed_memory
from pdserve.common.models import DecoderForCausalLM
from pdserve.common.models.decoder import build_model
from pdserve.common.models.precision import activation_dtype, cast_model, kv_cache_dtype
from pdserve.common.engine.grammar import Grammars
from pdserve.common.engine.host_copy import device_tensor, to_device
from pdserve.common.engine.logprobs import fill_prompt_logprobs, prompt_spans, raw_logprobs, token_logprobs
from pdserve.common.engine.sampler import Sampled, Sampler, make_generator
from pdserve.common.engine.scheduler import ScheduledBatch
from pdserve.common.engine.sequence import Sequence
from pdserve.common.engine.spec.verify import verify
from pdserve.common.loading.gguf_quant import cached_gguf_linears
from pdserve.common.loading.weights import load_weights
from pdserve.common.models.quantize import quantize_linears, set_quantized
from pdserve.common.quantization import gguf_source
from pdserve import kernels
from pdserve.kernels.cpu_decode import DecodeInputs


def kv_cache_shape(config: EngineConfig, num_blocks: int) -> tuple[int, ...]:
    """[2 (k, v), layers, num_blocks, block_size, kv_heads, head_dim] (the index order; on
    the CPU the memory order differs: `common.engine.kv_layout.kv_cache_tensor`)."""
    m = config.model
    return (2, m.num_layers, num_blocks, config.cache.block_size, m.num_kv_heads, m.head_dim)


def bytes_per_block(config: EngineConfig) -> int:
    shape = kv_cache_shape(config, 1)
    return int(np.prod(shape)) * torch.empty((), dtype=kv_cache_dtype(config.device)).element_size()


def decide_num_blocks(config: EngineConfig, speculates: bool = False) -> int:
    """Cache size in blocks: the configured count, else `memory_fraction` of device memory
    (shared, for an engine that `speculates` with another draft model, with the draft's KV
    cache of as many blocks: common/engine/spec/draft_model.py)."""
    if config.cache.num_kv_blocks is not None:
        n = config.cache.num_kv_blocks
    else:
        if config.device.device.startswith("cuda"):
            free, _ = torch.cuda.mem_get_info(torch.device(config.device.device))
            budget = free * config.cache.memory_fraction
        else:
            budget = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") * config.cache.memory_fraction
        per_block = bytes_per_block(config)
        spec = config.speculative if speculates else None
        if spec is not None and spec.method == "draft_model" and spec.model != "self":  # "self" shares this cache
            draft = ModelConfig.from_dir(spec.draft_dir(config.model.model_dir))
            per_block += bytes_per_block(dataclasses.replace(config, model=draft))
        n = int(budget // per_block)
    need = -(-config.scheduler.max_model_len // config.cache.block_size)
    if n < need:
        raise ConfigError(
            f"KV cache of {n} blocks cannot hold one sequence of max_model_len "
            f"{config.scheduler.max_model_len} ({need} blocks of {config.cache.block_size} tokens); "
            f"raise num_kv_blocks or lower max_model_len")
    return n


def quantize(model: DecoderForCausalLM, config: EngineConfig) -> None:
    """The model's linears in the engine's weight-only quantization (common/quantization.py)."""
    q = config.device.quantization
    if q in ("int8", "int4"):
        quantize_linears(model, q)
    elif q == "gguf":
        source = gguf_source(config.model.model_dir)
        if source is None:
            raise ConfigError(f"quantization 'gguf': the GGUF file {config.model.model_dir} was converted from "
                              "is gone or changed")
        set_quantized(model, cached_gguf_linears(source, config.model, config.model.model_dir))


def padded_tables(tables: list[list[int]], width: int | None = None) -> np.ndarray:
    """Block tables as one [len(tables), width] int32 array, -1 padded (width: the longest)."""
    width = max((len(t) for t in tables), default=0) if width is None else width
    out = np.full((len(tables), width), -1, dtype=np.int32)
    for i, t in enumerate(tables):
        out[i, :len(t)] = t
    return out


def prefill_metadata(q_lens: list[int], context_lens: list[int], tables: list[list[int]], first_row: int,
                     device: torch.device) -> PrefillMetadata:
    """The prompt chunks' metadata, its three tensors moved to `device` in one copy: block
    tables [P, max_blocks], cu_seqlens_q [P + 1] (from `first_row`, the decode rows before
    them) and context lengths [P], all int32."""
    p = len(q_lens)
    grid = padded_tables(tables)
    host = np.concatenate([grid.ravel(), first_row + np.cumsum([0, *q_lens], dtype=np.int32),
                           np.asarray(context_lens, dtype=np.int32)]).astype(np.int32, copy=False)
    dev = to_device(host, device)
    n = grid.size
    return PrefillMetadata(q_lens=q_lens, context_lens=context_lens, block_tables=dev[:n].view(p, grid.shape[1]),
                           cu_seqlens_q=dev[n:n + p + 1], context_lens_t=dev[n + p + 1:])


class ModelRunner:
    """Owns the model weights, the KV cache and sampling state of one engine."""

    def __init__(self, config: EngineConfig, kv_cache: torch.Tensor | None = None, speculates: bool = False) -> None:
        """`speculates`: a draft model will share the device's memory (`decide_num_blocks`)."""
        self.config = config
        dev = config.device
        if dev.num_threads:
            torch.set_num_threads(dev.num_threads)
        self.device = torch.device(dev.device)
        self.on_cpu = self.device.type == "cpu"  # read every step: one attribute, not two
        if self.device.type == "cpu":
            keep_freed_memory()
        self.block_size = config.cache.block_size
        # allocated where and as it runs, then filled: no random init (of up to billions of weights) first
        model = build_model(config.model, config.scheduler.max_model_len, self.device, activation_dtype(dev))
        load_weights(model, config.model.model_dir)
        self.model = cast_model(model, dev).eval().requires_grad_(False)  # bf16 on the CPU: stored, not computed in
        quantize(self.model, config)
        self.model.model.rope.to(torch.float32)  # cos/sin tables stay fp32 for accuracy
        if kv_cache is None:
            self.num_blocks = decide_num_blocks(config, speculates)
            kv_cache = kv_cache_tensor(kv_cache_shape(config, self.num_blocks), kv_cache_dtype(dev), self.device)
        else:
            self.num_blocks = kv_cache.shape[2]
        self.kv_cache = kv_cache
        self.model.kv_caches = [(kv_cache[0, i], kv_cache[1, i]) for i in range(config.model.num_layers)]
        self.sampler = Sampler(config.seed, dev.device)
        self.grammars = Grammars(config.model.model_dir, config.model.vocab_size)  # structured output
        self._generators: dict[int, torch.Generator] = {}
        self.rows_per_chunk = 1  # `as_rows`: a draft model's runner takes short chunks as rows too

    def release(self, seq_id: int) -> None:
        self._generators.pop(seq_id, None)

    def generator_state(self, seq_id: int) -> bytes:
        """The state of a seeded request's generator (b"" if it has none), to hand the
        request to another engine mid-stream."""
        gen = self._generators.get(seq_id)
        return b"" if gen is None else gen.get_state().numpy().tobytes()

    def generator_states(self, seqs: list[Sequence]) -> dict[int, bytes]:
        """The generator states of `seqs` that have one, to put back if a step fails."""
        return {s.seq_id: self.generator_state(s.seq_id) for s in seqs if s.seq_id in self._generators}

    def restore_generator_states(self, seqs: list[Sequence], states: dict[int, bytes]) -> None:
        for s in seqs:
            gen = self._generators.get(s.seq_id)
            if gen is not None and s.seq_id in states:
                gen.set_state(torch.frombuffer(bytearray(states[s.seq_id]), dtype=torch.uint8))

    def restore_generator(self, seq: Sequence, state: bytes) -> None:
        """Continue `seq`'s random stream from `state` (from `generator_state` of an
        engine on the same kind of device). Raises ValueError if it does not fit."""
        gen = self._generator(seq) if state else None
        if gen is None:
            return
        try:
            gen.set_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))
        except RuntimeError as e:
            raise ValueError(f"sampler state of {len(state)} bytes does not fit this engine's "
                             f"{self.config.device.device} generator: {e}") from None

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, layer_hook: Callable[[int], None] | None = None
                ) -> dict[int, Sampled]:
        """Run one step; returns {seq_id: sampled token} for seqs that completed all their
        tokens (a verified sequence's: the tokens it keeps, `Sampled.more`)."""
        rows = [self.as_rows(s, n) for s, n in zip(batch.seqs, batch.num_tokens)]
        if layer_hook is None and self.on_cpu and all(rows):
            sampled = self._decode_native(batch.seqs, batch.num_tokens)
            if sampled is not None:
                return sampled
        order = sorted(range(len(batch)), key=lambda i: not rows[i])  # one-query rows first
        seqs = [batch.seqs[i] for i in order]
        counts = [batch.num_tokens[i] for i in order]
        input_ids, positions, meta, sample_idx, sample_seqs = self.prepare(seqs, counts)
        # a pure decode step's linears: quantized weights by int8 dot products at any batch size
        with kernels.decode_rows(meta.num_decode == len(input_ids)):
            return self._execute(input_ids, positions, meta, sample_idx, sample_seqs, seqs, counts, layer_hook)

    def as_rows(self, seq: Sequence, n: int) -> bool:
        """Whether `seq`'s `n` scheduled tokens run as one-query rows, each attending to the
        cache up to its own position as a decode token does: one token; a verification
        (its last token, then its draft tokens `spec_token_ids`: each row computes, kernel
        for kernel, the logits a decode step at its position would, so speculation changes
        no greedy token); or, up to `rows_per_chunk` (a draft model's runner: more than 1),
        a chunk ending at its last token."""
        return n == 1 or bool(seq.spec_token_ids) or (
            n <= self.rows_per_chunk and seq.num_computed_tokens + n == len(seq) and seq.prompt_logprobs is None)

    @staticmethod
    def row_tokens(seq: Sequence, n: int) -> list[int]:
        """The token ids of `seq`'s `n` scheduled tokens: from its first uncomputed one,
        then its draft tokens."""
        p = seq.num_computed_tokens
        return [seq.token_ids[p], *seq.spec_token_ids] if seq.spec_token_ids else seq.token_ids[p:p + n]

    def _execute(self, input_ids: torch.Tensor, positions: torch.Tensor, meta, sample_idx: torch.Tensor,
                 sample_seqs: list[Sequence], seqs: list[Sequence], counts: list[int],
                 layer_hook: Callable[[int], None] | None) -> dict[int, Sampled]:
        spans = prompt_spans(seqs, counts)  # [] unless a sequence asks for its prompt's logprobs
        if spans:
            rows = to_device(torch.cat([torch.arange(sp.row, sp.row + sp.count) for sp in spans]), self.device)
            hidden = self.model(input_ids, positions, meta, layer_hook, keep=torch.cat([rows, sample_idx]))
            fill_prompt_logprobs(self.model.compute_logits, hidden[:len(rows)], spans)
            hidden = hidden[len(rows):]  # [S, hidden]
        else:
            # every row sampled (a decode batch): all of them, in order, without a copy
            keep = None if len(sample_idx) == len(input_ids) else sample_idx
            hidden = self.model(input_ids, positions, meta, layer_hook, keep=keep)  # [S, hidden]
        if not sample_seqs:
            return {}
        return self.sample(hidden, sample_seqs)

    def _decode_native(self, seqs: list[Sequence], counts: list[int] | None = None) -> dict[int, Sampled] | None:
        """A CPU batch of one-query rows each ending at its sequence's last token (or
        drafts), from token ids to logits and their argmax in the native stack's one call
        (`DecoderForCausalLM.decode_logits`), its inputs plain arrays (`decode_inputs`): no
        tensor is made on the way in, where `prepare` makes five. None where the stack does
        not apply: `prepare` and the model's forward then, with the same logits."""
        rows = self.decode_inputs(seqs, counts)
        fused = None if rows is None else self.model.decode_logits(rows)
        if fused is None:
            return None
        logits, top = fused
        if counts is not None and len(top) != len(seqs):
            idx: list[int] = []  # the rows sampled: a verification's every row, a chunk's last
            for s, n, end in zip(seqs, counts, itertools.accumulate(counts)):
                idx += range(end - n, end) if s.spec_token_ids else [end - 1]
            if len(idx) != len(top):
                logits, top = logits[idx], [top[i] for i in idx]
        return self.sample_logits(logits, seqs, top)

    def decode_inputs(self, seqs: list[Sequence], counts: list[int] | None = None) -> DecodeInputs | None:
        """The native stack's inputs for a batch of one-query rows (`counts`: each
        sequence's scheduled tokens, 1 if not given), in order; None for no rows or unless
        each sequence's rows end at its last token (then its drafts)."""
        if not seqs:
            return None
        if counts is None or not any(n > 1 for n in counts):  # one row per sequence: the decode step
            pos = [s.num_computed_tokens for s in seqs]
            if any(p + 1 != len(s) for s, p in zip(seqs, pos)):
                return None
            return DecodeInputs.of([s.token_ids[p] for s, p in zip(seqs, pos)], pos, [s.block_table for s in seqs],
                                   self.block_size)
        ids: list[int] = []
        pos = []
        tables: list[list[int]] = []
        for s, n in zip(seqs, counts):
            p = s.num_computed_tokens
            if p + n - len(s.spec_token_ids) != len(s) or (s.spec_token_ids and n != 1 + len(s.spec_token_ids)):
                return None
            ids += self.row_tokens(s, n)
            pos += range(p, p + n)
            tables += [s.block_table] * n
        return DecodeInputs.of(ids, pos, tables, self.block_size)

    @torch.inference_mode()
    def sample(self, hidden: torch.Tensor, seqs: list[Sequence]) -> dict[int, Sampled]:
        """hidden [S, hidden] of each seq's last token -> {seq_id: next token}."""
        return self.sample_logits(self.model.compute_logits(hidden), seqs)  # [S, V]

    def sample_logits(self, logits: torch.Tensor, seqs: list[Sequence], top: list[int] | None = None
                      ) -> dict[int, Sampled]:
        """logits [S, V] of each seq's last token (`top`: each row's argmax, if known) ->
        {seq_id: next token}. A seq with forks (n > 1, its prompt just computed) lends its
        logits row to each of them: every choice samples its first token from the same
        logits with its own generator. A verified sequence (`spec_token_ids`) has 1 + len
        of them rows, in order: `spec.verify` keeps its tokens."""
        if any(s.spec_token_ids for s in seqs):
            return self._sample_verified(logits, seqs, top)
        if any(s.forks for s in seqs):
            top = None
            logits = logits[[i for i, s in enumerate(seqs) for _ in range(1 + len(s.forks))]]  # [S + forks, V]
            seqs = [r for s in seqs for r in (s, *s.forks)]
        params = [s.sampling_params for s in seqs]
        raw = raw_logprobs(logits, params)  # None unless a row asks; taken before the grammar's mask
        # one check: a step without structured-output rows fills no mask
        bitmask = self.grammars.bitmask(seqs) if any(p.structured for p in params) else None
        tokens = self.sampler(logits, params, [self._generator(s) for s in seqs],
                              [s.token_ids for s in seqs], [s.num_prompt_tokens for s in seqs], bitmask, top)
        lps = token_logprobs(raw, params, tokens) if raw is not None else {}
        return {s.seq_id: Sampled(t, lps.get(i)) for i, (s, t) in enumerate(zip(seqs, tokens))}

    def _sample_verified(self, logits: torch.Tensor, seqs: list[Sequence], top: list[int] | None
                         ) -> dict[int, Sampled]:
        """`sample_logits` of a batch holding verified sequences: the others sampled as
        ever, the verified ones' rows through `spec.verify`."""
        plain_rows: list[int] = []
        spec_rows: list[int] = []
        r = 0
        for s in seqs:
            n = 1 + len(s.spec_token_ids)
            (spec_rows if s.spec_token_ids else plain_rows).extend(range(r, r + n))
            r += n
        pick = (lambda rows: None) if top is None else (lambda rows: [top[i] for i in rows])
        spec_seqs = [s for s in seqs if s.spec_token_ids]
        out = verify(logits[spec_rows], spec_seqs, pick(spec_rows), self.sampler, self.grammars,
                     [self._generator(s) for s in spec_seqs])
        plain = [s for s in seqs if not s.spec_token_ids]
        if plain:
            out.update(self.sample_logits(logits[plain_rows], plain, pick(plain_rows)))
        return out

    def prepare(self, seqs: list[Sequence], counts: list[int]
                ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor, list[Sequence]]:
        """Flatten a decode-first batch into model inputs and attention metadata."""
        if counts and all(n == 1 for n in counts):
            return self.prepare_decode(seqs)
        if counts and all(self.as_rows(s, n) for s, n in zip(seqs, counts)):
            return self.prepare_decode(seqs, counts)
        return self.prepare_mixed(seqs, counts)

    def prepare_mixed(self, seqs: list[Sequence], counts: list[int]
                      ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor, list[Sequence]]:
        """`prepare` for any decode-first batch (prompt chunks among it)."""
        bs = self.block_size
        ids: list[int] = []
        pos_chunks: list[np.ndarray] = []
        slot_chunks: list[np.ndarray] = []
        sample_idx: list[int] = []
        sample_seqs: list[Sequence] = []
        num_decode = 0
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        pre_q: list[int] = []
        pre_ctx: list[int] = []
        pre_tables: list[list[int]] = []
        offset = 0
        for seq, n in zip(seqs, counts):
            start = seq.num_computed_tokens
            end = start + n
            ids.extend(self.row_tokens(seq, n))
            pos = np.arange(start, end)
            table = np.asarray(seq.block_table, dtype=np.int64)
            pos_chunks.append(pos)
            slot_chunks.append(table[pos // bs] * bs + pos % bs)
            if self.as_rows(seq, n):  # (decode-first: these come before any prompt chunk)
                num_decode += n
                decode_tables += [seq.block_table] * n
                decode_lens += range(start + 1, end + 1)
            else:
                pre_q.append(n)
                pre_ctx.append(end)
                pre_tables.append(seq.block_table)
            offset += n
            if seq.spec_token_ids:  # a verification: every row's logits
                sample_idx += range(offset - n, offset)
                sample_seqs.append(seq)
            elif end == len(seq):
                sample_idx.append(offset - 1)
                sample_seqs.append(seq)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=to_device(np.concatenate(slot_chunks), dev),
            num_decode=num_decode,
            decode_block_tables=to_device(padded_tables(decode_tables), dev),
            decode_context_lens=device_tensor(decode_lens, torch.int32, dev),
            prefill=prefill_metadata(pre_q, pre_ctx, pre_tables, num_decode, dev) if pre_q else None,
        )
        input_ids = device_tensor(ids, torch.int64, dev)
        positions = to_device(np.concatenate(pos_chunks), dev)
        return input_ids, positions, meta, device_tensor(sample_idx, torch.int64, dev), sample_seqs

    def prepare_decode(self, seqs: list[Sequence], counts: list[int] | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor, list[Sequence]]:
        """`prepare` for a batch of one-query rows (`counts`: each sequence's, 1 if not
        given), from plain lists: a decode step's inputs in five tensors (a numpy array per
        sequence costs more than the step's Python elsewhere, its code cold after the
        weights streamed through the caches)."""
        bs, dev = self.block_size, self.device
        if counts is None or not any(n > 1 for n in counts):
            pos = [s.num_computed_tokens for s in seqs]
            ids = [s.token_ids[p] for s, p in zip(seqs, pos)]
            tables = [s.block_table for s in seqs]
            sampled = [i for i, (s, p) in enumerate(zip(seqs, pos)) if p + 1 == len(s)]
            sample_seqs = [seqs[i] for i in sampled]
        else:
            ids, pos, tables, sampled, sample_seqs = [], [], [], [], []
            for s, n in zip(seqs, counts):
                p, first = s.num_computed_tokens, len(pos)
                ids += self.row_tokens(s, n)
                pos += range(p, p + n)
                tables += [s.block_table] * n
                if s.spec_token_ids:  # a verification: every row's logits
                    sampled += range(first, first + n)
                    sample_seqs.append(s)
                elif p + n == len(s):
                    sampled.append(first + n - 1)
                    sample_seqs.append(s)
        width = max(len(t) for t in tables)
        meta = AttentionMetadata(
            slot_mapping=device_tensor([t[p // bs] * bs + p % bs for t, p in zip(tables, pos)], torch.int64, dev),
            num_decode=len(pos),
            decode_block_tables=device_tensor([t + [-1] * (width - len(t)) for t in tables], torch.int32, dev),
            decode_context_lens=device_tensor([p + 1 for p in pos], torch.int32, dev))
        input_ids = device_tensor(ids, torch.int64, dev)
        positions = device_tensor(pos, torch.int64, dev)
        return input_ids, positions, meta, device_tensor(sampled, torch.int64, dev), sample_seqs

    @torch.inference_mode()
    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy the KV of block src into block dst, every layer, for each (src, dst)."""
        if not pairs:
            return
        src, dst = (device_tensor(x, torch.int64, self.kv_cache.device) for x in zip(*pairs))
        self.kv_cache[:, :, dst] = self.kv_cache[:, :, src]  # [2, layers, len(pairs), block, heads, dim]

    def _generator(self, seq: Sequence) -> torch.Generator | None:
        seed = seq.sampling_params.seed
        if seed is None or seq.sampling_params.greedy:
            return None
        gen = self._generators.get(seq.seq_id)
        if gen is None:  # choice i of n: seed + i, so choice 0 keeps the stream an n = 1 request has
            gen = self._generators[seq.seq_id] = make_generator(seed + seq.index, self.config.device.device)
        return gen
