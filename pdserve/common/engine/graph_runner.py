"""Decode steps through static, bucket-padded buffers: on GPU each batch-size bucket is
captured once as a CUDA graph and replayed; on CPU the very same buffers and padding are
run eagerly, so the bucketing logic is exercised (and tested) without a GPU."""
from __future__ import annotations

from typing import Callable

import torch

from pdserve.common.models.attention import AttentionMetadata
from pdserve.common.config import EngineConfig
from pdserve.common.engine.model_runner import ModelRunner, Sampled
from pdserve.common.engine.scheduler import ScheduledBatch


def bucket_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 8 up to max_batch (vLLM's capture sizes, shortened)."""
    sizes = [b for b in (1, 2, 4) if b < max_batch] + list(range(8, max_batch + 8, 8))
    return sorted({min(b, max_batch) for b in sizes})


def pick_bucket(batch: int, buckets: list[int]) -> int | None:
    """Smallest bucket holding `batch` rows, or None when the batch is larger than all."""
    for b in buckets:
        if b >= batch:
            return b
    return None


class GraphRunner(ModelRunner):
    """A ModelRunner that also owns static decode buffers and (GPU) captured graphs, one
    per batch-size bucket. Anything that is not a pure decode batch runs eagerly as in
    ModelRunner. Chosen by `EngineConfig.decode_graphs` (the decode role)."""

    def __init__(self, config: EngineConfig, kv_cache: torch.Tensor | None = None, speculates: bool = False) -> None:
        super().__init__(config, kv_cache, speculates)
        cfg = config
        dev = self.device
        self.buckets = bucket_sizes(cfg.scheduler.max_num_seqs)
        self.max_blocks = -(-cfg.scheduler.max_model_len // cfg.cache.block_size)
        n = self.buckets[-1]
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=dev)
        self.block_tables = torch.full((n, self.max_blocks), -1, dtype=torch.int32, device=dev)
        self.context_lens = torch.zeros(n, dtype=torch.int32, device=dev)
        self.use_cuda_graphs = dev.type == "cuda"
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.replays = 0  # decode steps served from the static buffers (eager or graph)

    def execute(self, batch: ScheduledBatch, layer_hook: Callable[[int], None] | None = None) -> dict[int, Sampled]:
        bucket = pick_bucket(len(batch), self.buckets)
        if layer_hook is not None or bucket is None or any(n != 1 for n in batch.num_tokens) \
                or any(s.prompt_logprobs is not None for s in batch.seqs):  # a 1-token prompt chunk's logits
            return super().execute(batch, layer_hook)
        self.fill(batch, bucket)
        hidden = self.run_bucket(bucket)  # [bucket, hidden]
        self.replays += 1
        real = len(batch)
        return self.sample(hidden[:real], batch.seqs)

    @torch.inference_mode()
    def fill(self, batch: ScheduledBatch, bucket: int) -> None:
        """Write the batch into rows [0, len) and padding into [len, bucket) of the buffers."""
        bs = self.block_size
        b = len(batch)
        ids, pos, slots, lens = [], [], [], []
        table = torch.full((b, self.max_blocks), -1, dtype=torch.int32)
        for i, seq in enumerate(batch.seqs):
            p = seq.num_computed_tokens  # the one new token's position
            ids.append(seq.token_ids[p])
            pos.append(p)
            slots.append(seq.block_table[p // bs] * bs + p % bs)
            lens.append(p + 1)
            table[i, :len(seq.block_table)] = torch.tensor(seq.block_table, dtype=torch.int32)
        dev = self.input_ids.device
        self.input_ids[:b] = torch.tensor(ids, device=dev)
        self.positions[:b] = torch.tensor(pos, device=dev)
        self.slot_mapping[:b] = torch.tensor(slots, device=dev)
        self.context_lens[:b] = torch.tensor(lens, dtype=torch.int32, device=dev)
        self.block_tables[:b] = table.to(dev)
        # padding rows: token 0 at position 0, stored nowhere, attending to nothing
        self.input_ids[b:bucket] = 0
        self.positions[b:bucket] = 0
        self.slot_mapping[b:bucket] = -1
        self.context_lens[b:bucket] = 0
        self.block_tables[b:bucket] = -1

    def metadata(self, bucket: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bucket], num_decode=bucket,
            decode_block_tables=self.block_tables[:bucket], decode_context_lens=self.context_lens[:bucket],
            prefill_q_lens=[], prefill_context_lens=[], prefill_block_tables=[])

    @torch.inference_mode()
    def run_bucket(self, bucket: int) -> torch.Tensor:
        model = self.model
        if not self.use_cuda_graphs:
            return model(self.input_ids[:bucket], self.positions[:bucket], self.metadata(bucket))
        if bucket not in self.graphs:
            self.graphs[bucket] = self._capture(bucket)
        graph, out = self.graphs[bucket]
        graph.replay()
        return out

    def _capture(self, bucket: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """GPU only: warm up once on a side stream, then capture the bucket's forward."""
        model = self.model
        meta = self.metadata(bucket)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            model(self.input_ids[:bucket], self.positions[:bucket], meta)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = model(self.input_ids[:bucket], self.positions[:bucket], meta)
        return graph, out
