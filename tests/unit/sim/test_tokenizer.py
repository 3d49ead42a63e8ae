from __future__ import annotations

import json
import os

import pytest
from tokenizers import Tokenizer

from motor.protocol.chat_tokenizer import ENDOFTEXT_ID, IM_END_ID, IM_START_ID, VOCAB_SIZE
from motor.sim.tokenizer import load, write_model_dir


def test_model_dir_files_and_tokenizers_load(tmp_path):
    d = write_model_dir(tmp_path / "m")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "config.json"):
        assert (d / name).is_file()
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    assert tok.get_vocab_size(with_added_tokens=True) == VOCAB_SIZE
    assert tok.token_to_id("<|endoftext|>") == ENDOFTEXT_ID
    assert tok.token_to_id("<|im_start|>") == IM_START_ID
    assert tok.token_to_id("<|im_end|>") == IM_END_ID
    text = "héllo, wörld \n\t~"
    assert tok.encode(text, add_special_tokens=False).ids == list(text.encode())
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    assert cfg["eos_token"] == "<|im_end|>" and "chat_template" in cfg


def test_rewrite_is_idempotent(tmp_path):
    d = write_model_dir(tmp_path)
    before = {p: os.stat(d / p).st_mtime_ns for p in os.listdir(d)}
    write_model_dir(tmp_path)
    assert {p: os.stat(d / p).st_mtime_ns for p in os.listdir(d)} == before


def test_chat_template_token_counts(tmp_path):
    t = load(tmp_path)
    ids = t.encode(t.render_chat([{"role": "user", "content": "hi"}]))
    assert len(ids) == 21
    assert ids[0] == IM_START_ID and ids[-1] == ord("\n") and ids.count(IM_END_ID) == 1
    parts = [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {}},
             {"type": "text", "text": "b"}]
    assert (t.render_chat([{"role": "user", "content": parts}])
            == t.render_chat([{"role": "user", "content": "a\nb"}]))
    no_gen = t.render_chat([{"role": "user", "content": "hi"}], add_generation_prompt=False)
    assert no_gen == "<|im_start|>user\nhi<|im_end|>\n"
    cont = t.render_chat([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "He"}],
                         continue_final_message=True)
    assert cont.endswith("<|im_start|>assistant\nHe")


def test_special_tokens_in_text_and_decode(tmp_path):
    t = load(tmp_path)
    ids = t.encode("a<|im_end|>b")
    assert ids == [97, IM_END_ID, 98]
    assert t.decode(ids) == "a<|im_end|>b"


def test_transformers_autotokenizer_loads(tmp_path):
    transformers = pytest.importorskip("transformers")
    d = write_model_dir(tmp_path)
    tok = transformers.AutoTokenizer.from_pretrained(str(d))
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert len(ids) == 21
