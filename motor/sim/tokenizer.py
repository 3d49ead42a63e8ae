"""The simulator's tokenizer model directory (byte-level tokenizer, ChatML chat template).

The tokenizer itself (ids, special tokens, chat template) is the builtin one of
:mod:`motor.protocol.chat_tokenizer`, so that the coordinator's ``builtin`` routing
tokenizer counts tokens exactly as the simulator does. Here it is a ``tokenizers``
byte-level BPE with no merges, saved as an ordinary model directory (``tokenizer.json`` +
``tokenizer_config.json`` with the chat template + ``special_tokens_map.json`` + a minimal
``config.json``), so that the very same files load in ``tokenizers.Tokenizer.from_file``,
in HF ``AutoTokenizer`` and in a real vLLM engine, and all of them count tokens the same
way. ``[{"role": "user", "content": "hi"}]`` is 21 tokens.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from collections.abc import Iterable
from typing import Any

from motor.protocol.chat_tokenizer import (CHAT_TEMPLATE, ENDOFTEXT, ENDOFTEXT_ID, EOS_TOKEN_IDS,
                                           IM_END, SIM_TOKENIZER_DIR, SPECIAL_TOKENS,
                                           VOCAB_SIZE)

#: model_max_length / max_position_embeddings written to the directory: a constant, so that
#: simulators with different --max-model-len can share one directory
MODEL_MAX_LENGTH = 131072

#: Where the model directory is written and read unless told otherwise (``--model-dir``).
DEFAULT_MODEL_DIR = os.path.expanduser(SIM_TOKENIZER_DIR)


def _byte_to_char() -> dict[int, str]:
    """The byte -> printable character table of byte-level BPE (GPT-2's convention).

    Bytes that are visible Latin-1 characters stand for themselves; the others
    (control bytes, space, DEL, NBSP, soft hyphen, ...) are moved, in byte order, to
    the code points 256, 257, ...
    """
    keep = set(range(0x21, 0x7F)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    table: dict[int, str] = {}
    shifted = 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + shifted)
            shifted += 1
    return table


def build_tokenizer() -> Any:
    """A fresh ``tokenizers.Tokenizer``: id == byte value, plus the three special tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    table = _byte_to_char()
    vocab = {ch: b for b, ch in table.items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIAL_TOKENS])
    return tok


def _model_files() -> dict[str, str]:
    """File name -> exact text of every file of the model directory."""
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "model_max_length": MODEL_MAX_LENGTH,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    special_map = {"eos_token": IM_END, "pad_token": ENDOFTEXT}
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": VOCAB_SIZE,
        "max_position_embeddings": MODEL_MAX_LENGTH,
        "bos_token_id": None,
        "eos_token_id": list(EOS_TOKEN_IDS),
        "pad_token_id": ENDOFTEXT_ID,
        "motor_sim": True,
    }
    return {
        "tokenizer.json": build_tokenizer().to_str(pretty=True),
        "tokenizer_config.json": json.dumps(tok_config, indent=2) + "\n",
        "special_tokens_map.json": json.dumps(special_map, indent=2) + "\n",
        "config.json": json.dumps(config, indent=2) + "\n",
    }


def write_model_dir(path: str | os.PathLike[str] | None = None) -> Path:
    """Write (or refresh) the tokenizer model directory at ``path``; returns it.

    Files whose content is already right are left alone; others are written to a
    temporary file and renamed, so concurrent simulators sharing the default
    directory never see a half-written file.
    """
    d = Path(path or DEFAULT_MODEL_DIR).expanduser()
    try:
        d.mkdir(parents=True, exist_ok=True)
        _write_files(d)
    except OSError:
        if path is not None and str(path) != DEFAULT_MODEL_DIR:
            raise
        # no writable home (containers): fall back to a per-user temp directory
        d = Path(tempfile.gettempdir()) / f"motor-sim-tokenizer-{os.getuid()}"
        d.mkdir(parents=True, exist_ok=True)
        _write_files(d)
    return d


def _write_files(d: Path) -> None:
    for name, text in _model_files().items():
        target = d / name
        try:
            if target.read_text(encoding="utf-8") == text:
                continue
        except (OSError, UnicodeDecodeError):
            pass
        fd, tmp = tempfile.mkstemp(prefix=f".{name}.", dir=d)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
            os.replace(tmp, target)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise


class SimTokenizer:
    """Loads a model directory and encodes, decodes and renders chats like the engine does."""

    def __init__(self, model_dir: str | os.PathLike[str]) -> None:
        from jinja2.sandbox import ImmutableSandboxedEnvironment
        from tokenizers import Tokenizer

        self.model_dir = Path(model_dir)
        self._tok = Tokenizer.from_file(str(self.model_dir / "tokenizer.json"))
        with open(self.model_dir / "tokenizer_config.json", encoding="utf-8") as f:
            cfg = json.load(f)
        self.chat_template_source: str = cfg.get("chat_template") or CHAT_TEMPLATE
        self.vocab_size: int = self._tok.get_vocab_size(with_added_tokens=True)
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

        def raise_exception(message: str) -> None:
            raise ValueError(message)

        env.globals["raise_exception"] = raise_exception
        self._template = env.from_string(self.chat_template_source)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; special-token strings in it become special tokens."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, i: int) -> str | None:
        return self._tok.id_to_token(i)

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    continue_final_message: bool = False, **kwargs: Any) -> str:
        """The prompt text of a chat (``continue_final_message`` drops the last message's end)."""
        text = self._template.render(messages=messages, add_generation_prompt=add_generation_prompt
                                     and not continue_final_message, **kwargs)
        if continue_final_message and messages:
            tail = IM_END + "\n"
            if text.endswith(tail):
                text = text[: -len(tail)]
        return text


def load(model_dir: str | os.PathLike[str] | None = None) -> SimTokenizer:
    """Write the model directory if needed and load it."""
    return SimTokenizer(write_model_dir(model_dir))
