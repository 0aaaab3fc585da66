"""Decode steps through static, bucket-padded buffers: on GPU each batch-size bucket is
captured once as a CUDA graph and replayed; on CPU the very same buffers and padding are
run eagerly, so the bucketing logic is exercised (and tested) without a GPU."""
from __future__ import annotations

from itertools import chain
from typing import Callable

import numpy as np
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
        # The static buffers the graphs read, in two device tensors: int64 [3, n] (token ids,
        # positions, slots) and int32 [n * max_blocks + n] (block tables, then context
        # lengths); a step writes them through pinned host twins of the same layout and
        # three copies that do not wait for the device (`fill`).
        pin = dev.type == "cuda"
        self._i64 = torch.zeros(3, n, dtype=torch.int64, device=dev)
        self._i32 = torch.zeros(n * self.max_blocks + n, dtype=torch.int32, device=dev)
        self._host_i64 = torch.zeros(3, n, dtype=torch.int64, pin_memory=pin)
        self._host_i32 = torch.zeros(n * self.max_blocks + n, dtype=torch.int32, pin_memory=pin)
        self._copied = torch.cuda.Event() if pin else None  # the last step's copies out of the host twins
        self.input_ids, self.positions, self.slot_mapping = self._i64
        self.block_tables = self._i32[:n * self.max_blocks].view(n, self.max_blocks)
        self.context_lens = self._i32[n * self.max_blocks:]
        self.slot_mapping.fill_(-1)
        self.block_tables.fill_(-1)
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
        """Write the batch into rows [0, len) and padding into [len, bucket) of the buffers:
        on the host twins, then one copy per buffer queued on the stream without waiting
        (the graph replayed after them reads what they wrote). Padding rows: token 0 at
        position 0, stored nowhere, attending to nothing."""
        bs, b, width = self.block_size, len(batch), self.max_blocks
        if self._copied is not None:
            self._copied.synchronize()  # the last step's copies have left the host twins (at once: it sampled since)
        host = self._host_i64.numpy()  # [3, n]: ids, positions, slots
        pos = [seq.num_computed_tokens for seq in batch.seqs]  # each row's one new token's position
        host[0, :b] = [seq.token_ids[p] for seq, p in zip(batch.seqs, pos)]
        host[1, :b] = pos
        host[2, :b] = [seq.block_table[p // bs] * bs + p % bs for seq, p in zip(batch.seqs, pos)]
        host[:2, b:bucket] = 0
        host[2, b:bucket] = -1
        flat = self._host_i32.numpy()
        tables = flat[:bucket * width].reshape(bucket, width)
        lens = flat[-self.input_ids.shape[0]:]
        tables.fill(-1)
        counts = np.fromiter((len(seq.block_table) for seq in batch.seqs), np.int64, b)
        if b:
            # every table's entries at once: row i, columns 0 .. len(table i) - 1
            entries = np.fromiter(chain.from_iterable(seq.block_table for seq in batch.seqs), np.int32, int(counts.sum()))
            rows = np.repeat(np.arange(b), counts)
            cols = np.arange(len(entries)) - np.repeat(np.cumsum(counts) - counts, counts)
            tables[rows, cols] = entries
        lens[:b] = host[1, :b] + 1
        lens[b:bucket] = 0
        self._i64.copy_(self._host_i64, non_blocking=True)
        self.block_tables[:bucket].copy_(self._host_i32[:bucket * width].view(bucket, width), non_blocking=True)
        self.context_lens[:bucket].copy_(self._host_i32[-len(lens):][:bucket], non_blocking=True)
        if self._copied is not None:
            self._copied.record()

    def metadata(self, bucket: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bucket], num_decode=bucket,
            decode_block_tables=self.block_tables[:bucket], decode_context_lens=self.context_lens[:bucket])

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
