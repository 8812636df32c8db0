"""The default target: GGUF -> cached HF directory parity, cache repair, offline hub ids, chat template."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from eyas.common import EyasError, cache_dir
from eyas.target import load_target
from eyas.target.load import _gguf_key, smollm2_gguf_path

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three prime numbers."}],
    [{"role": "user", "content": "Write a haiku about rain."}, {"role": "assistant", "content": "Soft rain on the roof."},
     {"role": "user", "content": "Another one, about snow."}],
]


def test_cached_directory_matches_the_gguf_model(smollm2):
    from transformers import AutoModelForCausalLM

    gguf = smollm2_gguf_path()
    reference = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    for chat in CHATS:
        ids = smollm2.tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt",
                                                    return_dict=True)["input_ids"]
        with torch.no_grad():
            want = reference(ids).logits
            got = smollm2.model(ids).logits
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_identity_and_shape(smollm2):
    assert (smollm2.num_layers, smollm2.hidden_size, smollm2.vocab_size) == (30, 576, 49152)
    assert set(smollm2.identity) == {"name", "config_hash", "tokenizer_hash"}
    assert smollm2.identity["name"] == "SmolLM2-135M-Instruct"
    assert not any(p.requires_grad for p in smollm2.model.parameters())


def test_chat_template_renders_two_turns(smollm2):
    chat = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "How are you?"}, {"role": "assistant", "content": "Fine, thanks."}]
    text = smollm2.tokenizer.apply_chat_template(chat, tokenize=False)
    assert text.count("<|im_start|>user\n") == 2 and text.count("<|im_start|>assistant\n") == 2
    assert "Hi there<|im_end|>" in text and "Fine, thanks.<|im_end|>" in text
    assert text.index("Hi there") < text.index("Hello!") < text.index("How are you?") < text.index("Fine, thanks.")


def test_final_hidden_state_is_post_norm(smollm2):
    """transformers appends index n AFTER the final norm: pin it, since capture relies on it."""
    ids = torch.tensor([[1, 504, 3458, 314, 260, 1345]])
    seen = {}
    handle = smollm2.layers[-1].register_forward_hook(lambda m, a, out: seen.setdefault("last", out[0] if isinstance(out, tuple) else out))
    try:
        with torch.no_grad():
            out = smollm2.model(ids, output_hidden_states=True)
    finally:
        handle.remove()
    hs = out.hidden_states
    assert len(hs) == smollm2.num_layers + 1
    torch.testing.assert_close(hs[-1], smollm2.norm(seen["last"]))
    torch.testing.assert_close(out.logits, smollm2.lm_head(hs[-1]))
    assert not torch.allclose(hs[-1], seen["last"])


def test_corrupt_cache_entry_is_rebuilt_by_concurrent_loaders(tmp_path, smollm2):
    """A truncated entry is detected; two first loads at once serialise on the lock and both succeed."""
    key = _gguf_key(smollm2_gguf_path())[:24]
    src = cache_dir() / "hf" / key
    cache = tmp_path / "cache"
    shutil.copytree(src, cache / "hf" / key)
    weights = cache / "hf" / key / "model.safetensors"
    with open(weights, "r+b") as f:
        f.truncate(weights.stat().st_size // 2)
    env = {**os.environ, "EYAS_CACHE": str(cache)}
    code = ("import torch; from eyas.target import load_target; t = load_target('smollm2');"
            "print('SUM', float(t.model.model.norm.weight.sum()), t.identity['config_hash'])")
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    sums = [line for out in outs for line in out.splitlines() if line.startswith("SUM")]
    assert len(sums) == 2 and sums[0] == sums[1]
    assert sum("incomplete or corrupt; rebuilding" in out for out in outs) == 1  # exactly one rebuilt
    assert weights.stat().st_size == (src / "model.safetensors").stat().st_size
    assert not [p for p in (cache / "hf").iterdir() if p.name.startswith(".")]  # no temp dirs left behind


def test_hub_id_fails_cleanly_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(EyasError) as e:
        load_target("someorg/not-a-real-model", device="cpu")
    msg = str(e.value)
    assert "\n" not in msg and "hub" in msg and "local directory" in msg


def test_bad_specs_are_explained(tmp_path):
    with pytest.raises(EyasError, match="does not exist"):
        load_target(str(tmp_path / "nope.gguf"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(EyasError, match="without config.json"):
        load_target(str(tmp_path / "empty"))


def test_local_hf_directory_loads(tmp_path, tiny_target):
    tiny_target.model.save_pretrained(tmp_path / "m")
    tiny_target.tokenizer.save_pretrained(tmp_path / "m")
    again = load_target(str(tmp_path / "m"), device="cpu")
    ids = torch.tensor([[5, 6, 7, 8]])
    torch.testing.assert_close(again.model(ids).logits, tiny_target.model(ids).logits)
    assert again.identity["config_hash"] == tiny_target.identity["config_hash"]
    assert again.identity["tokenizer_hash"] == tiny_target.identity["tokenizer_hash"]


def test_tokenizer_hash_follows_what_the_tokenizer_does(smollm2, monkeypatch):
    """Not how a library version serialises it (two transformers versions gave the same SmolLM2 tokenizer two
    hashes, and capture then refused a dataset prepared on the other machine); any change of behaviour shows."""
    import copy

    from eyas.target.load import tokenizer_hash

    tok = smollm2.tokenizer
    base = tokenizer_hash(tok)
    assert base == smollm2.identity["tokenizer_hash"]
    backend = type(tok.backend_tokenizer)
    monkeypatch.setattr(backend, "to_str", lambda self, *a, **k: "another serialisation", raising=False)
    assert tokenizer_hash(tok) == base
    other = copy.deepcopy(tok)
    other.chat_template = tok.chat_template.replace("<|im_start|>", "<|im_start|> ")
    assert tokenizer_hash(other) != base
    other = copy.deepcopy(tok)
    other.add_tokens(["<eyas-new-token>"])
    assert tokenizer_hash(other) != base


def test_unloadable_targets_are_one_line_errors(tmp_path, monkeypatch, tiny_target):
    """A corrupt GGUF, a broken config.json and a directory without tokenizer files: no traceback."""
    monkeypatch.setenv("EYAS_CACHE", str(tmp_path / "cache"))
    bad_gguf = tmp_path / "broken.gguf"
    bad_gguf.write_bytes(b"not a gguf file" * 100)
    with pytest.raises(EyasError, match=r"cannot load GGUF file .*broken\.gguf.*magic") as e:
        load_target(str(bad_gguf), device="cpu")
    assert "\n" not in str(e.value)
    assert not [p for p in (tmp_path / "cache" / "hf").iterdir() if p.is_dir()]  # no half-built entry

    bad_config = tmp_path / "bad_config"
    bad_config.mkdir()
    (bad_config / "config.json").write_text("{not json")
    with pytest.raises(EyasError, match=r"cannot load the target from .*bad_config.*config\.json"):
        load_target(str(bad_config), device="cpu")

    no_tokenizer = tmp_path / "no_tokenizer"
    tiny_target.model.save_pretrained(no_tokenizer)
    with pytest.raises(EyasError, match=r"cannot load the target from .*no_tokenizer") as e:
        load_target(str(no_tokenizer), device="cpu")
    assert "\n" not in str(e.value)


def test_a_target_that_ships_its_own_code_needs_trust_remote_code(tmp_path, tiny_target, monkeypatch):
    """Refused with the option's name, without a question on the terminal and without running the code;
    loaded (running the code) only with trust_remote_code."""
    import json

    model_dir = tmp_path / "remote"
    tiny_target.model.save_pretrained(model_dir)
    tiny_target.tokenizer.save_pretrained(model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg.update(model_type="eyas-test-remote",
               auto_map={"AutoConfig": "remote_model.RemoteConfig", "AutoModelForCausalLM": "remote_model.RemoteLM"})
    (model_dir / "config.json").write_text(json.dumps(cfg))
    (model_dir / "remote_model.py").write_text(
        "from pathlib import Path\n"
        "from transformers import LlamaConfig, LlamaForCausalLM\n"
        f"Path({str(model_dir / 'RAN')!r}).write_text('remote code ran')\n\n\n"
        "class RemoteConfig(LlamaConfig):\n    model_type = 'eyas-test-remote'\n\n\n"
        "class RemoteLM(LlamaForCausalLM):\n    config_class = RemoteConfig\n")
    asked = []
    monkeypatch.setattr("builtins.input", lambda *a: asked.append(a) or "y")
    with pytest.raises(EyasError, match=r"ships Python code of its own.*--set target.trust_remote_code=true") as e:
        load_target(str(model_dir), device="cpu")
    assert "\n" not in str(e.value)
    assert asked == [] and not (model_dir / "RAN").exists()
    target = load_target(str(model_dir), device="cpu", trust_remote_code=True)
    assert type(target.model).__name__ == "RemoteLM" and (model_dir / "RAN").exists() and asked == []


def test_the_gguf_names_the_special_tokens(smollm2):
    """The converted tokenizer's special tokens are the GGUF's own ids, not what a transformers version's GGUF
    reader makes of them (5.17 named <|im_start|> as eos, 5.19 <|im_end|>: one GGUF, two tokenizer hashes)."""
    from eyas.target.load import CONVERSION, gguf_special_tokens

    tok = smollm2.tokenizer
    named = gguf_special_tokens(smollm2_gguf_path(), tok)
    assert named == {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "unk_token": "<|endoftext|>",
                     "pad_token": "<|im_end|>"}
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 2)  # the GGUF's metadata ids
    entry = cache_dir() / "hf" / _gguf_key(smollm2_gguf_path())[:24]
    assert json.loads((entry / "COMPLETE.json").read_text())["conversion"] == CONVERSION


def test_an_entry_of_an_older_conversion_is_rebuilt(tmp_path, smollm2, monkeypatch, capsys):
    from eyas.target import load as load_module

    key = _gguf_key(smollm2_gguf_path())[:24]
    current = cache_dir() / "hf" / key
    cache = tmp_path / "cache"
    shutil.copytree(current, cache / "hf" / key)
    marker = cache / "hf" / key / "COMPLETE.json"
    old = json.loads(marker.read_text())
    del old["conversion"]  # as the earlier conversion wrote it
    marker.write_text(json.dumps(old))
    monkeypatch.setenv("EYAS_CACHE", str(cache))
    built = []

    def build(gguf, entry):  # the conversion itself is timed elsewhere: its result, copied into place
        built.append(entry)
        shutil.copytree(current, entry)

    monkeypatch.setattr(load_module, "_build_entry", build)
    entry = load_module.converted_gguf_dir(smollm2_gguf_path())
    assert built == [cache / "hf" / key] == [entry]
    assert "was built by an older conversion; rebuilding it" in capsys.readouterr().out
    assert json.loads(marker.read_text())["conversion"] == load_module.CONVERSION
    load_module.converted_gguf_dir(smollm2_gguf_path())
    assert len(built) == 1  # a current entry is used as it is
