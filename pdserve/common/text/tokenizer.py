"""Tokenizer loading (tokenizer.json via `tokenizers`, chat template via jinja2) and the
offline training of the byte-level BPE tokenizer that `pdserve make-model` ships."""
from __future__ import annotations

import json
import random
from pathlib import Path

from typing import Any

from tokenizers import AddedToken
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from pdserve.common.text.chat_template import ChatTemplateError, load_chat_template
from pdserve.common.config import ConfigError, read_json

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Word stock for the synthetic training corpus: enough variety for a few thousand merges.
_WORDS = """the of and to in is was for on that with as by at from it an be this are or
which have not has had but were their one all can more other been would its new also
time first two into only after over most people some could system model serving request
token cache prefill decode latency throughput batch queue worker router block memory
transfer device kernel attention layer engine server client stream output input prompt
sequence schedule policy metric goodput budget prefix hash load event handoff graph
tensor weight value key query head dimension length rate second minute hour day week
year city river mountain ocean forest garden house street market school library
music story river light water fire stone cloud rain snow wind north south east west
red green blue yellow black white small large long short early late fast slow quick
bright dark warm cold happy quiet loud gentle simple clever careful strange ancient
modern open close begin finish build write read send receive measure compare answer
question explain describe remember imagine travel return follow lead carry hold""".split()


def train_bpe_tokenizer(vocab_size: int, seed: int) -> HFTokenizer:
    """A byte-level BPE trained on a deterministic synthetic corpus (no download)."""
    rng = random.Random(seed)
    corpus = []
    for _ in range(4000):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 16))]
        if rng.random() < 0.3:
            words.append(str(rng.randint(0, 9999)))
        sentence = " ".join(words)
        corpus.append(sentence[0].upper() + sentence[1:] + rng.choice([".", "?", "!", ",", ":"]))
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(corpus, trainer=trainer)
    return tok


def add_plain_tokens(tok: HFTokenizer, tokens: list[str]) -> None:
    """Add `tokens` as added tokens that are not special (as Qwen3 has `<think>` and
    `<tool_call>`): each is one id, and decoding keeps its text."""
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in tokens])


def save_tokenizer(tok: HFTokenizer, out_dir: Path, model_max_length: int, chat_template: str = CHAT_TEMPLATE,
                   plain_tokens: list[str] | None = None) -> None:
    """tokenizer.json and tokenizer_config.json; `plain_tokens` are the not-special added
    tokens (`add_plain_tokens`) to list in added_tokens_decoder."""
    tok.save(str(out_dir / "tokenizer.json"))
    added = {str(tok.token_to_id(t)): {"content": t, "special": t in SPECIAL_TOKENS, "lstrip": False, "rstrip": False,
                                       "normalized": False, "single_word": False}
             for t in [*SPECIAL_TOKENS, *(plain_tokens or ())]}
    (out_dir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "chat_template": chat_template,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
    }, indent=2))


def _tokenizer_config(model_dir: Path) -> dict:
    path = model_dir / "tokenizer_config.json"
    return read_json(path) if path.is_file() else {}


def _eos_token(cfg: dict) -> str | None:
    eos = cfg.get("eos_token")
    return eos.get("content") if isinstance(eos, dict) else eos


def eos_token_id(model_dir: str | Path) -> int | None:
    """The id of tokenizer_config.json's eos_token, what `Tokenizer(model_dir).eos_token_id`
    is, read from tokenizer.json without building a tokenizer: the engine needs no more
    of it (workers never decode text)."""
    model_dir = Path(model_dir)
    eos = _eos_token(_tokenizer_config(model_dir))
    if not eos:
        return None
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        raise ConfigError(f"{path} not found: the model directory needs a tokenizer.json")
    data = read_json(path)
    # token_to_id's order: added tokens first, then the model's vocabulary
    for added in data.get("added_tokens") or []:
        if isinstance(added, dict) and added.get("content") == eos and isinstance(added.get("id"), int):
            return added["id"]
    vocab = data.get("model", {}).get("vocab") if isinstance(data.get("model"), dict) else None
    if isinstance(vocab, dict):
        found = vocab.get(eos)
        return found if isinstance(found, int) else None
    return Tokenizer(model_dir).eos_token_id  # another vocabulary form (unigram's list): ask the library


class Tokenizer:
    """Owns a model directory's tokenizer.json and chat template.

    Loaded with `tokenizers` directly: AutoTokenizer picks the wrong class for some
    Qwen2 folders."""

    def __init__(self, model_dir: str | Path) -> None:
        path = Path(model_dir) / "tokenizer.json"
        if not path.is_file():
            raise ConfigError(f"{path} not found: the model directory needs a tokenizer.json")
        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # the tokenizers library raises a bare Exception
            raise ConfigError(f"cannot load tokenizer {path}: {e}") from None
        cfg = _tokenizer_config(Path(model_dir))
        self.chat_template = load_chat_template(Path(model_dir), cfg)
        eos = _eos_token(cfg)
        self.eos_token_id = self._tok.token_to_id(eos) if eos else None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; `add_special_tokens` applies tokenizer.json's post-processor
        (a Llama-3 BOS, for one), as transformers' and vLLM's default for a plain prompt
        does. Off by default: a chat template already carries its special tokens."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, continue_final_message: bool = False,
                            template_kwargs: dict[str, Any] | None = None) -> str:
        """The prompt text; ChatTemplateError when the model has no template or it refuses
        these messages. `continue_final_message` leaves the last message open (no
        generation prompt, the text cut right after its content, as transformers does);
        `template_kwargs` are extra template variables (Qwen3's `enable_thinking`)."""
        if self.chat_template is None:
            raise ChatTemplateError("this model has no chat template (chat_template.jinja, or chat_template "
                                    "in tokenizer_config.json); send a plain prompt instead")
        text = self.chat_template.render(messages, add_generation_prompt=add_generation_prompt and
                                         not continue_final_message, tools=tools, variables=template_kwargs)
        return continue_final(text, messages[-1].get("content") or "") if continue_final_message else text


def continue_final(rendered: str, final: str) -> str:
    """`rendered` cut right after the last occurrence of the final message's content, so
    the model continues it (transformers' continue_final_message: the template's
    end-of-turn after it is dropped)."""
    for needle in (final, final.strip()):
        at = rendered.rfind(needle) if needle else -1
        if at >= 0:
            return rendered[:at + len(needle)]
    raise ChatTemplateError("continue_final_message: the final message's content does not appear in the "
                            "rendered chat template (an empty final message cannot be continued)")
