"""Compiles the Triton attention kernels for sm_90 (an H100 / H200) without a GPU -- Triton's
own ptxas -- at the configurations the engine launches, and prints one JSON line per kernel:
registers and stack (spilled) bytes per thread. Run in a process of its own with
TRITON_INTERPRET=0 (the interpreter replaces the kernels at definition):

    TRITON_INTERPRET=0 python -m tests.support.compile_sm90
"""
from __future__ import annotations

import json
import os
import subprocess
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from pdserve.kernels import paged_attention as decode
from pdserve.kernels import prefill_attention as prefill

# (dtype, GQA group, head_dim): an 8B model in bf16 (Llama-3 / Qwen3), the test models in float32
SHAPES = [(torch.bfloat16, 4, 128), (torch.float32, 2, 32)]


def usage(fn, pointers: dict[str, str], consts: dict, warps: int, stages: int = 2) -> dict:
    sig = {n: "constexpr" if n in consts else pointers.get(n, "fp32" if n == "scale_log2" else "i32")
           for n in fn.arg_names}
    src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()})
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        text = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    fields = dict(part.split(":") for part in next(ln for ln in text.splitlines() if "REG:" in ln).split())
    return {"kernel": fn.__name__, "regs": int(fields["REG"]), "stack": int(fields["STACK"])}


def main() -> None:
    for dtype, group, d in SHAPES:
        ty = "*bf16" if dtype == torch.bfloat16 else "*fp32"
        data = dict.fromkeys(("out_ptr", "q_ptr", "k_cache_ptr", "v_cache_ptr"), ty)
        block_g, block_d = triton.next_power_of_2(group), max(16, triton.next_power_of_2(d))
        tok_m, block_n, warps, stages = prefill._tiles(dtype, block_g, block_d)
        ieee = dtype == torch.float32
        rows = [usage(prefill._paged_prefill_kernel, {**data, "block_tables_ptr": "*i32", "cu_seqlens_q_ptr": "*i32",
                                                      "context_lens_ptr": "*i32"},
                      dict(GROUP=group, D=d, BLOCK_SIZE=16, BLOCK_G=block_g, TOK_M=tok_m, BLOCK_N=block_n,
                           BLOCK_D=block_d, IEEE=ieee), warps, stages)]
        for one_pass in (True, False):
            rows.append(usage(decode._decode_split_kernel, {**data, "part_ptr": "*fp32", "block_tables_ptr": "*i32",
                                                            "context_lens_ptr": "*i32"},
                              dict(GROUP=group, D=d, BLOCK_SIZE=16, ROWS=max(16, block_g), BLOCK_N=decode.BLOCK_N,
                                   BLOCK_D=block_d, ONE_PASS=one_pass, IEEE=ieee), decode.WARPS.get(dtype, 4)))
        rows.append(usage(decode._decode_merge_kernel, {"out_ptr": ty, "part_ptr": "*fp32"},
                          dict(D=d, BLOCK_D=block_d, BLOCK_S=decode.MAX_SPLITS), 4))
        for row in rows:
            print(json.dumps({"dtype": str(dtype).removeprefix("torch."), "group": group, "head_dim": d, **row}))


if __name__ == "__main__":
    main()
