"""GGUF -> HuggingFace-format folder (float32 safetensors, config.json,
generation_config.json, tokenizer.json, tokenizer_config.json, chat_template.jinja, and
gguf_source.json naming the file, whose quantized linears `--quantization gguf` reads and
keeps repacked in gguf_linears.cache).

Reading, dequantizing and un-permuting GGUF tensors, and rebuilding the fast tokenizer
from GGUF metadata, are transformers' GGUF loader's job (backed by the `gguf` package);
this module only checks the input, drives it, and writes the folder atomically."""
from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

from pdserve.common.config import SUPPORTED_ARCHS, ConfigError
from pdserve.common.quantization import write_gguf_source

GGUF_MAGIC = b"GGUF"
WEIGHTS_FILE = "model.safetensors"


def gguf_header(path: Path) -> tuple[str, int | None]:
    """(`general.architecture`, `{arch}.attention.key_length` or None) of a GGUF file, or
    ConfigError if it is not one."""
    from gguf import GGUFReader
    with open(path, "rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise ConfigError(f"{path} is not a GGUF file (no GGUF magic bytes)")
    try:
        fields = GGUFReader(str(path)).fields
        field = fields["general.architecture"]
        arch = bytes(field.parts[field.data[0]]).decode("utf-8")
        key_length = fields.get(f"{arch}.attention.key_length")
        head_dim = int(key_length.parts[key_length.data[0]][0]) if key_length is not None else None
    except (KeyError, ValueError, IndexError) as e:
        raise ConfigError(f"cannot read GGUF metadata of {path}: {e}") from None
    return arch, head_dim


def convert_gguf(gguf_path: str | Path, out_dir: str | Path, quiet: bool = False) -> Path:
    """Write `out_dir` from a llama / qwen2 / qwen3 GGUF file; returns `out_dir`.
    The folder appears complete or not at all (written beside it, then renamed)."""
    src, out = Path(gguf_path), Path(out_dir)
    if not src.is_file():
        raise ConfigError(f"GGUF file {src} not found")
    arch, head_dim = gguf_header(src)
    if arch not in SUPPORTED_ARCHS:
        raise ConfigError(f"{src}: GGUF architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHS)})")
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"output folder {out} exists and is not empty")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.converting-"))
    try:
        if not quiet:
            print(f"pdserve: converting {src.name} ({arch}) to a HuggingFace-format folder {out} ...",
                  file=sys.stderr, flush=True)
        _write_folder(src, tmp, quiet, arch, head_dim)
        write_gguf_source(tmp, src)  # for --quantization gguf: its linears as the file stores them
        tmp.chmod(0o755)  # mkdtemp makes it private; a model folder is not secret
        if out.exists():
            out.rmdir()  # empty, checked above
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _write_folder(src: Path, dst: Path, quiet: bool, arch: str, head_dim: int | None) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    if quiet:
        hf_logging.disable_progress_bar()
    try:
        tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
        # transformers does not map qwen3's attention.key_length to head_dim (its config
        # default, 128, only fits some sizes), so pass what the file says
        extra = {"head_dim": head_dim} if head_dim is not None and arch == "qwen3" else {}
        model = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=torch.float32, **extra)
    except (ValueError, OSError, KeyError, NotImplementedError) as e:
        raise ConfigError(f"transformers cannot load {src}: {e}") from None
    finally:
        if quiet:
            hf_logging.enable_progress_bar()
    cfg = model.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "transformers_version"):
        cfg.pop(key, None)
    cfg["dtype"] = "float32"
    (dst / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
    if cfg.get("eos_token_id") is not None and cfg["eos_token_id"] not in eos:
        eos.append(cfg["eos_token_id"])
    gen = {"bos_token_id": cfg.get("bos_token_id"), "eos_token_id": eos, "pad_token_id": cfg.get("pad_token_id")}
    (dst / "generation_config.json").write_text(json.dumps(gen, indent=2))
    # tied checkpoints store the embedding once, as transformers' own save does
    tensors = {name: t.detach().to(torch.float32).contiguous().clone()
               for name, t in model.state_dict().items()
               if not (cfg.get("tie_word_embeddings") and name == "lm_head.weight")}
    save_file(tensors, str(dst / WEIGHTS_FILE), metadata={"format": "pt"})
    tok.save_pretrained(str(dst))
    tok_cfg = json.loads((dst / "tokenizer_config.json").read_text())
    for key in ("is_local", "local_files_only"):  # facts about this load, not the model
        tok_cfg.pop(key, None)
    # the class transformers 4 knows too; 5 reads the same tokenizer.json either way
    tok_cfg.update(tokenizer_class="PreTrainedTokenizerFast", model_max_length=cfg.get("max_position_embeddings"))
    (dst / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))
    if tok.chat_template and not (dst / "chat_template.jinja").is_file():
        (dst / "chat_template.jinja").write_text(tok.chat_template)
