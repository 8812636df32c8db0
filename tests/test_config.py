import pytest

from eyas.config import ConfigError, EvalConfig, PRESETS, load_config


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_resolve(name):
    cfg = load_config(name)
    assert cfg.name == name
    assert cfg.train.ttt >= 1 and cfg.data.max_length >= 8


def test_overrides_are_type_checked():
    cfg = load_config("tiny", ["train.lr=3e-4", "train.steps=7", "data.strict=true",
                               "target.aux_layers=1,2,3", "eval.tree=none", "data.data=a.jsonl,b.jsonl"])
    assert cfg.train.lr == 3e-4 and isinstance(cfg.train.lr, float)
    assert cfg.train.steps == 7 and cfg.data.strict is True
    assert cfg.target.aux_layers == [1, 2, 3]
    assert cfg.eval.tree is None
    assert cfg.data.data == ["a.jsonl", "b.jsonl"]


def test_a_list_may_be_written_as_yaml_writes_it():
    cfg = load_config("tiny", ["eval.steps=[3, 5]", "eval.benches=[mt-bench]", "data.data=a.jsonl, b.jsonl"])
    assert cfg.eval.steps == [3, 5] and cfg.eval.benches == ["mt-bench"]
    assert cfg.data.data == ["a.jsonl", "b.jsonl"]  # no stray spaces in the names


@pytest.mark.parametrize("item, words", [
    ("train.nope=1", ["unknown key train.nope", "valid keys:", "lr", "ttt"]),
    ("bogus.lr=1", ["unknown config section 'bogus'", "train"]),
    ("train.steps=ten", ["train.steps", "expected an integer", "'ten'"]),
    ("train.lr=fast", ["train.lr", "expected a number"]),
    ("data.strict=maybe", ["data.strict", "true or false"]),
    ("data.on_long=cut", ["data.on_long='cut'", "drop", "truncate"]),
    ("capture.dtype=int4", ["capture.dtype", "fp8"]),
    ("target.aux_layers=3,2", ["distinct and ascending"]),
    ("train.lr", ["section.key=value"]),
    ("data.regenerate=vllm", ["data.regenerate='vllm'", "none, local", "http://"]),
    ("data.regen_batch_size=0", ["data.regen_batch_size=0", ">= 1"]),
    ("data.regen_max_new_tokens=0", ["data.regen_max_new_tokens=0", ">= 1"]),
    ("data.regen_temperature=-0.5", ["data.regen_temperature=-0.5", ">= 0"]),
    ("data.regen_timeout_s=0", ["data.regen_timeout_s=0", "> 0"]),
    ("target.device=gpu", ["target.device='gpu'", "auto, cpu, cuda, cuda:N"]),
    ("target.model=", ["target.model is empty", "smollm2"]),
    ("train.log_every=0", ["train.log_every=0", ">= 1"]),
    ("train.save_every=0", ["train.save_every=0", ">= 1"]),
    ("train.loss_decay=0", ["train.loss_decay=0.0", "(0, 1]"]),
    ("train.min_lr_ratio=1.5", ["train.min_lr_ratio=1.5", "[0.0, 1.0]"]),
    ("train.adam_beta2=1", ["train.adam_beta2=1.0", "(0, 1)"]),
    ("train.grad_clip=0", ["train.grad_clip=0.0", "> 0"]),
    ("train.warmup_steps=-1", ["train.warmup_steps=-1", ">= 0"]),
    ("capture.ram_budget_gb=-2", ["capture.ram_budget_gb=-2.0", ">= 0"]),
    ("eval.benches=", ["eval.benches is empty", "mt-bench"]),
    ("eval.steps=", ["eval.steps=[]", ">= 1"]),
    ("eval.max_new_tokens=0", ["eval.max_new_tokens=0", ">= 1"]),
    ("export.formats=", ["export.formats is empty", "sglang, vllm, speculators"]),
    ("name.x=1", ["name: expected a string", "name=VALUE"]),
])
def test_bad_overrides_give_one_line_errors(item, words):
    with pytest.raises(ConfigError) as e:
        load_config("tiny", [item])
    msg = str(e.value)
    assert "\n" not in msg
    for w in words:
        assert w in msg, msg


def test_values_at_their_limits_are_accepted():
    cfg = load_config("tiny", ["name=mine", "data.regenerate=http://127.0.0.1:8000/v1", "target.device=cuda:3",
                               "train.loss_decay=1", "train.min_lr_ratio=0", "train.warmup_steps=0",
                               "data.regen_retries=0", "data.stop_tokens=<|endoftext|>", "eval.temperature=0"])
    assert cfg.name == "mine" and cfg.data.regenerate == "http://127.0.0.1:8000/v1"
    assert cfg.target.device == "cuda:3" and cfg.data.stop_tokens == ["<|endoftext|>"]
    assert load_config("tiny", ["data.regenerate=none"]).data.regenerate is None


def test_compile_draft_is_an_eval_key():
    """Off by default and set like any key; whether the target can use it is eval's check (build_engine)."""
    assert EvalConfig().compile_draft is False and EvalConfig(compile_draft=True).compile_draft is True
    assert load_config("demo", ["eval.compile_draft=true"]).eval.compile_draft is True
    assert load_config("demo").eval.compile_draft is False


def test_yaml_extends_a_preset(tmp_path):
    p = tmp_path / "my.yaml"
    p.write_text("preset: tiny\nname: mine\ntrain:\n  steps: 3\n  lr: 0.002\neval:\n  steps: [3, 5]\n")
    cfg = load_config(str(p), ["train.steps=4"])
    assert cfg.name == "mine" and cfg.train.steps == 4 and cfg.train.lr == 0.002
    assert cfg.eval.steps == [3, 5]
    assert cfg.target.model == "tiny"  # inherited from the preset


def test_yaml_errors_name_the_key(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("train:\n  step: 3\n")
    with pytest.raises(ConfigError, match="unknown key train.step; valid keys: steps"):
        load_config(str(p))
    with pytest.raises(ConfigError, match="neither a preset"):
        load_config(str(tmp_path / "missing.yaml"))
    p.write_text("train: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(str(p))


def test_resolved_config_round_trips(tmp_path):
    import yaml

    from eyas.common import save_config
    from eyas.config import config_from_dict

    cfg = load_config("demo", ["train.steps=5"])
    save_config(cfg, tmp_path / "config.yaml")
    again = config_from_dict(yaml.safe_load((tmp_path / "config.yaml").read_text()))
    assert again == cfg


@pytest.mark.parametrize("name", list(PRESETS))
def test_rerun_from_saved_config_keeps_every_stage_fingerprint(tmp_path, name):
    """`eyas run --run-dir RUN` without --preset reloads RUN/config.yaml: every stage's config fingerprint
    must be the one the preset gave, or the rerun redoes finished stages (the full preset's `epochs=4`
    once came back as 4.0 and retrained a finished draft on the H200)."""
    from eyas.common import save_config
    from eyas.pipeline import STAGES, fingerprint_parts

    first = load_config(name)
    save_config(first, tmp_path / "config.yaml")
    again = load_config(str(tmp_path / "config.yaml"))
    for stage in STAGES:
        assert fingerprint_parts(stage, again, tmp_path)["config"] == fingerprint_parts(stage, first, tmp_path)["config"], stage.name


@pytest.mark.parametrize("item, words", [
    ("train.lr=nan", ["train.lr='nan'", "finite number"]),
    ("train.lr=1e999", ["train.lr='1e999'", "finite number"]),
    ("train.epochs=inf", ["train.epochs='inf'", "finite number"]),
    ("data.regen_timeout_s=-inf", ["data.regen_timeout_s", "finite number"]),
    ("train.lr=0", ["train.lr=0.0", "(0, 1]"]),
    ("train.lr=1.5", ["train.lr=1.5", "(0, 1]", "typical"]),
    ("train.ttt=0", ["train.ttt=0", "[1, 64]"]),
    ("train.ttt=65", ["train.ttt=65", "[1, 64]", "memory grows with ttt"]),
    ("train.max_bad_steps=0", ["train.max_bad_steps=0", ">= 1"]),
    ("train.save_every_minutes=-1", ["train.save_every_minutes=-1.0", ">= 0"]),
    ("data.max_record_mb=0", ["data.max_record_mb=0.0", "> 0"]),
    ("target.trust_remote_code=perhaps", ["target.trust_remote_code", "true or false"]),
    ("target.engine=[1, 2]", ["target.engine", "mapping"]),
    ("target.engine={a: .inf}", ["target.engine", "JSON values"]),
    ("data.self_prompts=5", ["data.self_prompts=5", "needs data.regenerate"]),
])
def test_values_out_of_bounds_are_refused_when_the_config_is_built(item, words):
    with pytest.raises(ConfigError) as e:
        load_config("tiny", [item, "data.regenerate=none"] if item.startswith("data.self_prompts") else [item])
    msg = str(e.value)
    assert "\n" not in msg and all(w in msg for w in words), msg


def test_options_of_two_sections_are_checked_together():
    with pytest.raises(ConfigError, match=r"train.ttt=9 is longer than data.max_length=8"):
        load_config("tiny", ["train.ttt=9", "data.max_length=8"])
    assert load_config("tiny", ["train.ttt=8", "data.max_length=8"]).train.ttt == 8


def test_a_config_built_in_code_is_held_to_the_same_rules():
    from eyas.config import DataConfig, TargetConfig, TrainConfig

    with pytest.raises(ConfigError, match="train.lr='fast': expected|train.lr: expected a number"):
        TrainConfig(lr="fast")
    with pytest.raises(ConfigError, match="finite number"):
        TrainConfig(lr=float("nan"))
    with pytest.raises(ConfigError, match="target.trust_remote_code: expected true or false"):
        TargetConfig(trust_remote_code="yes please")
    assert TrainConfig(epochs=4).epochs == 4.0 and isinstance(TrainConfig(epochs=4).epochs, float)
    assert TrainConfig(lr=1).lr == 1.0  # the upper bound itself is allowed


def test_a_file_that_is_not_yaml_text_is_refused(tmp_path):
    from eyas.config import MAX_CONFIG_BYTES

    binary = tmp_path / "model.bin"
    binary.write_bytes(bytes(range(255, -1, -1)))
    with pytest.raises(ConfigError, match=r"model.bin: not a YAML text file \(byte 0 is not UTF-8\)"):
        load_config(str(binary))
    big = tmp_path / "big.yaml"
    big.write_text("#" * (MAX_CONFIG_BYTES + 1))
    with pytest.raises(ConfigError, match="too large for a config file"):
        load_config(str(big))
    nan = tmp_path / "nan.yaml"
    nan.write_text("preset: tiny\ntrain:\n  lr: .nan\n")
    with pytest.raises(ConfigError, match="train.lr=nan: expected a finite number"):
        load_config(str(nan))


def test_online_capture_through_vllm_is_refused():
    with pytest.raises(ConfigError, match=r"capture.mode=online runs the target with transformers.*capture.mode=store"):
        load_config("tiny", ["target.backend=vllm", "capture.mode=online"])
    assert load_config("tiny", ["target.backend=vllm"]).capture.mode == "store"
