"""The stage table: skip what is done, resume what was interrupted, rerun what changed; capture and
training at once on disjoint device sets; foreign GPU holders make the runner refuse (or wait).

The runner is the real one, in process; the stages are fake_stage.py (pipeline_fakes.py).
"""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from pipeline_fakes import fake_stage

from eyas.common import EyasError
from eyas.config import load_config
from eyas.gpu import nvml
from eyas.pipeline import STAGES, RunOptions, StageFailed, run_pipeline

QUIET = RunOptions(gpus=[], echo=False, grace_s=0.5)


def started(record: Path) -> list[dict]:
    if not record.exists():
        return []
    return [r for r in map(json.loads, record.read_text().splitlines()) if r["result"] == "started"]


def counts(record: Path) -> dict[str, int]:
    found: dict[str, int] = {}
    for r in started(record):
        found[r["name"]] = found.get(r["name"], 0) + 1
    return found


def chain(tmp_path: Path, fail_flag: Path | None = None, b_args=()):
    rec = ["--record", str(tmp_path / "record.jsonl")]
    fail = ["--fail-if", str(fail_flag)] if fail_flag else []
    return (fake_stage("a", "a", rec, config=["data"]),
            fake_stage("b", "b", rec + fail + list(b_args), reads=["a"], config=["train"]),
            fake_stage("c", "c", rec, reads=["b"], config=["eval"]))


def status(run: Path) -> dict[str, str]:
    return {k: v["status"] for k, v in json.loads((run / "stages.json").read_text())["stages"].items()}


def test_skip_rerun_on_change_and_removed_output(tmp_path):
    run, record, stages = tmp_path / "run", tmp_path / "record.jsonl", chain(tmp_path)
    run_pipeline(load_config("tiny"), run, QUIET, stages)
    assert counts(record) == {"a": 1, "b": 1, "c": 1}
    assert (run / "report.md").exists() and (run / "config.yaml").exists()

    t0 = time.monotonic()
    run_pipeline(load_config("tiny"), run, QUIET, stages)
    assert time.monotonic() - t0 < 2.0
    assert counts(record) == {"a": 1, "b": 1, "c": 1}  # all skipped

    (run / "b" / "stale").write_text("from the old config")
    run_pipeline(load_config("tiny", ["train.lr=0.5"]), run, QUIET, stages)
    assert counts(record) == {"a": 1, "b": 2, "c": 2}  # b's config changed, so did c's input
    assert not (run / "b" / "stale").exists()
    assert started(record)[-2]["resume"] is False

    (run / "c" / "item-0").unlink()
    run_pipeline(load_config("tiny", ["train.lr=0.5"]), run, QUIET, stages)
    assert counts(record) == {"a": 1, "b": 2, "c": 3}
    assert status(run) == {"a": "done", "b": "done", "c": "done"}


def test_a_config_change_is_named_in_the_log(tmp_path, capsys):
    """A record keeps the stage's config values beside their hash: the log names the keys that changed."""
    from eyas.pipeline import config_values

    cfg = load_config("tiny")
    run, record, stages = tmp_path / "run", tmp_path / "record.jsonl", chain(tmp_path)
    run_pipeline(cfg, run, QUIET, stages)
    recorded = json.loads((run / "stages.json").read_text())["stages"]["a"]
    assert recorded["config_values"] == config_values(stages[0], cfg)
    run_pipeline(load_config("tiny", [f"data.num_prompts={cfg.data.num_prompts + 1}"]), run, QUIET, stages)
    assert counts(record) == {"a": 2, "b": 2, "c": 2}
    assert "a: running (inputs changed (config: data.num_prompts): old output removed)" in capsys.readouterr().out


def test_a_key_that_a_later_eyas_added_reruns_nothing_at_its_default(tmp_path, capsys):
    """A record written before a config key existed: the key at its default skips the stage (an upgrade of eyas
    redoes no finished work); the key at another value reruns it, named in the log."""
    from eyas.common import sha256_json
    from eyas.config import TrainConfig

    cfg = load_config("tiny")
    assert cfg.train.mask_oov_target == TrainConfig().mask_oov_target is False
    run, record, stages = tmp_path / "run", tmp_path / "record.jsonl", chain(tmp_path)
    run_pipeline(cfg, run, QUIET, stages)
    state = json.loads((run / "stages.json").read_text())
    b = state["stages"]["b"]
    del b["config_values"]["train"]["mask_oov_target"]  # as an eyas without that key recorded it
    b["parts"]["config"] = sha256_json(b["config_values"])
    (run / "stages.json").write_text(json.dumps(state))

    run_pipeline(cfg, run, QUIET, stages)
    assert counts(record) == {"a": 1, "b": 1, "c": 1}
    run_pipeline(load_config("tiny", ["train.mask_oov_target=true"]), run, QUIET, stages)
    assert counts(record) == {"a": 1, "b": 2, "c": 2}
    assert "b: running (inputs changed (config: train.mask_oov_target): old output removed)" in capsys.readouterr().out


@pytest.mark.parametrize("written", [{"a": {"status": "done"}}, {"schema_version": 1, "stages": {}}, "{not json"])
def test_stages_json_of_another_schema_is_refused_and_nothing_is_touched(tmp_path, written):
    """A run directory whose stages.json has another schema version (or none) stops the run with a clear
    error before anything is written or removed there."""
    run, stages = tmp_path / "run", chain(tmp_path)
    run_pipeline(load_config("tiny"), run, QUIET, stages)
    (run / "stages.json").write_text(written if isinstance(written, str) else json.dumps(written))
    before = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in run.rglob("*") if p.is_file()}
    found = "none" if "schema_version" not in written else "1"
    with pytest.raises(EyasError, match=rf"stages.json has schema_version {found}, this eyas reads 2: use a new "
                                        rf"--run-dir, or remove .*stages.json to rerun every stage"):
        run_pipeline(load_config("tiny", ["train.lr=0.5"]), run, QUIET, stages)
    assert {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in run.rglob("*") if p.is_file()} == before
    assert counts(tmp_path / "record.jsonl") == {"a": 1, "b": 1, "c": 1}


def test_a_draft_to_fine_tune_inside_the_run_is_refused_before_anything_is_removed(tmp_path):
    """Setting train.init_from changes the train stage's inputs, so the runner would remove RUN/train (or later
    RUN/export) while it holds the draft to fine-tune: refused up front, nothing touched; so is a data file in a
    stage's output."""
    run, stages = tmp_path / "run", chain(tmp_path)
    run_pipeline(load_config("tiny"), run, QUIET, stages)
    before = sorted(str(p.relative_to(run)) for p in run.rglob("*"))
    for inside in (run / "b", run / "c" / "speculators", run):
        cfg = load_config("tiny", [f"train.init_from={inside}"])
        with pytest.raises(EyasError, match="lies in the run directory .* copy the draft elsewhere first"):
            run_pipeline(cfg, run, QUIET, stages)
    assert sorted(str(p.relative_to(run)) for p in run.rglob("*")) == before
    assert counts(tmp_path / "record.jsonl") == {"a": 1, "b": 1, "c": 1}
    (run / "a" / "mine.jsonl").write_text("{}\n")
    with pytest.raises(EyasError, match=r"data.data file .*mine.jsonl lies in .*a, which the run replaces"):
        run_pipeline(load_config("tiny", [f"data.data={run / 'a' / 'mine.jsonl'}"]), run, QUIET, stages)
    assert (run / "a" / "mine.jsonl").exists()
    (run / "a" / "mine.jsonl").unlink()  # a's output as it was
    outside = tmp_path / "draft"
    outside.mkdir()
    run_pipeline(load_config("tiny", [f"train.init_from={outside}"]), run, QUIET, stages)  # b's config changed
    assert counts(tmp_path / "record.jsonl") == {"a": 1, "b": 2, "c": 2}


def test_failed_stage_resumes_and_later_stages_wait(tmp_path):
    run, record, flag = tmp_path / "run", tmp_path / "record.jsonl", tmp_path / "break-b"
    flag.write_text("")
    stages = chain(tmp_path, flag)
    with pytest.raises(StageFailed, match="b exited with code 3"):
        run_pipeline(load_config("tiny"), run, QUIET, stages)
    assert status(run) == {"a": "done", "b": "failed"}
    flag.unlink()
    run_pipeline(load_config("tiny"), run, QUIET, stages)
    assert counts(record) == {"a": 1, "b": 2, "c": 1}
    assert started(record)[-2] | {"t_start": 0, "pid": 0} == {
        "name": "b", "pid": 0, "resume": True, "tail": False, "cuda": None, "t_start": 0, "result": "started"}


def test_a_stage_that_exits_0_without_its_output_fails_until_it_writes_it(tmp_path):
    """The fingerprint of a missing output would match forever: marked done, the stage were never run again."""
    run, record = tmp_path / "run", tmp_path / "record.jsonl"
    for attempt in (1, 2):
        with pytest.raises(StageFailed, match=r"b .*code 0 but did not write .*b; check its log .*b\.log and rerun"):
            run_pipeline(load_config("tiny"), run, QUIET, chain(tmp_path, b_args=["--mode", "silent"]))
        assert status(run) == {"a": "done", "b": "failed"} and counts(record) == {"a": 1, "b": attempt}
    run_pipeline(load_config("tiny"), run, QUIET, chain(tmp_path))
    assert counts(record) == {"a": 1, "b": 3, "c": 1} and status(run)["b"] == "done"


def overlap_stages(tmp_path: Path, capture_args=(), train_args=(), delay=0.15):
    rec = ["--record", str(tmp_path / "record.jsonl")]
    store = tmp_path / "run" / "store"
    return (fake_stage("capture", "store", rec + ["--items", "4", "--delay", str(delay), *capture_args],
                       config=["capture"], gpus="all"),
            fake_stage("train", "train", rec + ["--follow", str(store), *train_args], reads=["store"], gpus="all",
                       tails="capture"))


@pytest.fixture
def fake_gpus(monkeypatch):
    """Device indices that exist only for the scheduler: NVML is hidden even on a GPU machine."""
    monkeypatch.setattr(nvml, "available", lambda: False)


def by_name(record: Path) -> dict[str, dict]:
    found = {}
    for r in map(json.loads, record.read_text().splitlines()):
        found.setdefault(r["name"], {}).update(r)
    return found


def test_capture_and_train_share_time_on_disjoint_gpus(tmp_path, fake_gpus):
    run_pipeline(load_config("tiny"), tmp_path / "run", RunOptions(gpus=[0, 1, 2], echo=False),
                 overlap_stages(tmp_path))
    r = by_name(tmp_path / "record.jsonl")
    assert r["capture"]["cuda"] == "0,1" and r["train"]["cuda"] == "2"
    assert r["train"]["tail"] and not r["capture"]["tail"]
    assert r["train"]["t_start"] < r["capture"]["t_end"]  # training started while capture still wrote
    assert status(tmp_path / "run") == {"capture": "done", "train": "done"}


@pytest.mark.parametrize("gpus", [[0], []])
def test_one_gpu_or_none_runs_stages_one_after_another(tmp_path, fake_gpus, gpus):
    run_pipeline(load_config("tiny"), tmp_path / "run", RunOptions(gpus=gpus, echo=False), overlap_stages(tmp_path))
    r = by_name(tmp_path / "record.jsonl")
    assert r["train"]["t_start"] >= r["capture"]["t_end"] and not r["train"]["tail"]
    assert r["capture"]["cuda"] == r["train"]["cuda"] == ("0" if gpus else None)


def test_a_failed_capture_ends_the_training_that_tails_it(tmp_path, fake_gpus):
    with pytest.raises(StageFailed, match="capture exited"):
        run_pipeline(load_config("tiny"), tmp_path / "run", RunOptions(gpus=[0, 1], echo=False, grace_s=0.5),
                     overlap_stages(tmp_path, ["--mode", "fail"]))
    assert status(tmp_path / "run") == {"capture": "failed", "train": "failed"}
    assert "t_end" not in by_name(tmp_path / "record.jsonl").get("train", {})
    recs = json.loads((tmp_path / "run" / "processes.json").read_text())["stages"]
    assert all(r["ended"] for r in recs)


@pytest.mark.parametrize("other_capture", [False, True])
@pytest.mark.parametrize("fails", ["during capture", "after capture"])
def test_an_overlapped_train_resumes_with_its_checkpoints(tmp_path, fake_gpus, fails, other_capture):
    """The store train tailed grew under it: that is no change of its input, so a rerun resumes train (its
    checkpoints kept) whether it stopped while capture wrote or after; a capture rerun with other settings
    (a new store) still starts train afresh."""
    run, record, flag = tmp_path / "run", tmp_path / "record.jsonl", tmp_path / "break-train"
    flag.write_text("")
    fail = "--fail-if-mid" if fails == "during capture" else "--fail-if-late"
    stages = overlap_stages(tmp_path, train_args=[fail, str(flag)], delay=0.4)
    opts = RunOptions(gpus=[0, 1], echo=False, grace_s=0.5)
    with pytest.raises(StageFailed, match="train exited with code 3"):
        run_pipeline(load_config("tiny"), run, opts, stages)
    assert status(run) == {"capture": "done" if fails == "after capture" else "failed", "train": "failed"}
    checkpoint = run / "train" / "step-0000100" / "model.safetensors"
    checkpoint.parent.mkdir(parents=True)
    checkpoint.write_text("weights")
    flag.unlink()
    run_pipeline(load_config("tiny", ["capture.shard_tokens=1024"] if other_capture else []), run, opts, stages)
    last_train = [r for r in started(record) if r["name"] == "train"][-1]
    assert (last_train["resume"], checkpoint.exists()) == (not other_capture, not other_capture)
    assert counts(record)["capture"] == (1 if fails == "after capture" and not other_capture else 2)
    assert status(run) == {"capture": "done", "train": "done"}
    run_pipeline(load_config("tiny", ["capture.shard_tokens=1024"] if other_capture else []), run, opts, stages)
    assert counts(record)["train"] == 2  # done: skipped


@pytest.fixture
def foreign_gpu_holder(monkeypatch):
    """NVML as seen on a GPU where a process of someone else's holds memory on device 0."""
    decoy = subprocess.Popen(["sleep", "1000"])
    polls = {"n": 0}

    def holders(devices=None):
        polls["n"] += 1
        if polls["n"] > polls.get("free_after", 10**9):
            return []
        return [nvml.Holder(0, decoy.pid, "someone", "sleep 1000", 512.0)]

    monkeypatch.setattr(nvml, "available", lambda: True)
    monkeypatch.setattr(nvml, "gpus", lambda: [nvml.Gpu(0, "fake", 512.0, 81920.0)])
    monkeypatch.setattr(nvml, "holders", holders)
    monkeypatch.setattr(nvml, "used_mib", lambda devices: {d: 512.0 for d in devices})
    yield decoy, polls
    decoy.kill()
    decoy.wait()


def test_foreign_gpu_holder_makes_the_runner_refuse(tmp_path, foreign_gpu_holder):
    decoy, _ = foreign_gpu_holder
    record = tmp_path / "record.jsonl"
    stage = fake_stage("prepare", "prepared", ["--record", str(record)], gpus="one")
    with pytest.raises(EyasError, match=rf"(?s)did not start.*{decoy.pid}.*someone.*sleep 1000"):
        run_pipeline(load_config("tiny"), tmp_path / "run", RunOptions(gpus=[0], echo=False), (stage,))
    assert decoy.poll() is None and not record.exists()


def test_wait_for_gpus_waits_for_the_foreign_holder_to_leave(tmp_path, foreign_gpu_holder):
    _, polls = foreign_gpu_holder
    polls["free_after"] = 2
    record = tmp_path / "record.jsonl"
    stage = fake_stage("prepare", "prepared", ["--record", str(record)], gpus="one")
    run_pipeline(load_config("tiny"), tmp_path / "run", RunOptions(gpus=[0], wait_for_gpus=30, echo=False), (stage,))
    assert counts(record) == {"prepare": 1}


def test_real_stage_table_commands(tmp_path):
    """The real table names each stage command with the run's config and paths (no stage is run)."""
    from eyas.pipeline import Ctx

    cfg = load_config("tiny")
    names = [s.name for s in STAGES if s.when(cfg)]
    assert names == ["prepare", "capture", "train", "eval", "export"]
    ctx = Ctx(cfg, tmp_path, num_devices=2, resume=True, tail=True)
    argv = {s.name: [c.argv for c in s.commands(ctx)] for s in STAGES}
    assert argv["capture"][0][:4] == [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    train = argv["train"][0]
    assert "--tail" in train and "--resume" in train
    assert train[train.index("--vocab") + 1] == str(tmp_path / "prepared" / "vocab.safetensors")
    fine_tune = load_config("tiny", ["train.init_from=/drafts/code"])  # keeps its own vocabulary
    assert "--vocab" not in next(s for s in STAGES if s.name == "train").commands(Ctx(fine_tune, tmp_path, 1, False,
                                                                                      False))[0].argv
    # one eval process per benchmark (tiny: mt-bench only), every setting of the config in it; done when the
    # last setting's result exists
    (eval_cmd,) = next(s for s in STAGES if s.name == "eval").commands(ctx)
    assert "--out-dir" in eval_cmd.argv and "--steps" not in eval_cmd.argv and "--tree" not in eval_cmd.argv
    assert eval_cmd.out == str(tmp_path / "eval" / "mt-bench-tree-2x3x6.json")
    (export,) = argv["export"]
    assert export[export.index("--to") + 1] == "sglang,vllm,speculators" and export[-1] == str(tmp_path / "export")
    online = load_config("tiny", ["capture.mode=online"])
    assert [s.name for s in STAGES if s.when(online)] == ["prepare", "train", "eval", "export"]
    train = next(s for s in STAGES if s.name == "train").commands(Ctx(online, tmp_path, 1, False, False))[0].argv
    assert train[train.index("--source") + 1] == "online" and train[:3] == [sys.executable, "-m", "eyas"]
    assert "--vocab" not in train  # read from the prepared data itself


def test_the_stage_table_writes_where_the_layout_says():
    from eyas.layout import RunLayout

    layout = RunLayout(Path("/runs/r"))
    df = layout.family("dflash")
    # in run order: both families trained before either is evaluated
    assert [layout.run / s.writes for s in STAGES] == [layout.prepared, layout.store, layout.train, df.train,
                                                       layout.eval, layout.export, df.eval, df.export]
    assert (df.train, df.eval, df.exported("vllm")) == (Path("/runs/r/train-dflash"), Path("/runs/r/eval-dflash"),
                                                        Path("/runs/r/export-dflash/vllm"))
    assert (layout.vocab, layout.stages, layout.lock) == (Path("/runs/r/prepared/vocab.safetensors"),
                                                          Path("/runs/r/stages.json"), Path("/runs/r/.runner.lock"))
    assert layout.eval_result("mt-bench", "chain-3") == Path("/runs/r/eval/mt-bench-chain-3.json")


def test_eval_results_are_the_result_files_only(tmp_path):
    """The run report lists RUN/eval's results: not the stage summary, not eyas's hidden ownership marker."""
    from eyas.layout import RunLayout, eval_result_name
    from eyas.ownership import claim

    layout = RunLayout(tmp_path / "run")
    claim(layout.eval, "eval")
    result = layout.eval_result("mt-bench", "chain-3")
    for path in (result, layout.eval / "summary.json"):
        path.write_text("{}")
    assert layout.eval_results() == [result] and result.name == eval_result_name("mt-bench", "chain-3")


def test_one_runner_per_run_dir(tmp_path):
    from eyas.ownership import exclusive

    run = tmp_path / "run"
    with exclusive(run / ".runner.lock", "held by the test"):
        with pytest.raises(EyasError, match="another `eyas run` works there"):
            run_pipeline(load_config("tiny"), run, QUIET, chain(tmp_path))
    assert not (tmp_path / "record.jsonl").exists()


def test_an_input_edited_while_its_stage_runs_reruns_it_next_time(tmp_path):
    """The record keeps the inputs as the stage started with them: an input file edited while the stage ran
    was not what it used, so the next run must rerun the stage (it was fingerprinted again at the end, and
    the edit was taken as used)."""
    import dataclasses
    import threading

    data = tmp_path / "data.jsonl"
    data.write_text("first\n")
    rec = ["--record", str(tmp_path / "record.jsonl")]
    slow = fake_stage("a", "a", rec + ["--items", "3", "--delay", "0.4"], config=["data"])
    stages = (dataclasses.replace(slow, external=lambda cfg: [str(data)]),)
    edit = threading.Timer(0.5, lambda: data.write_text("second, edited while a ran\n"))
    edit.start()
    run_pipeline(load_config("tiny"), tmp_path / "run", QUIET, stages)
    edit.join()
    assert counts(tmp_path / "record.jsonl") == {"a": 1}
    run_pipeline(load_config("tiny"), tmp_path / "run", QUIET, stages)
    assert counts(tmp_path / "record.jsonl") == {"a": 2}  # the edit is seen as a change
    run_pipeline(load_config("tiny"), tmp_path / "run", QUIET, stages)
    assert counts(tmp_path / "record.jsonl") == {"a": 2}  # and once used, it is done


def test_target_weights_replaced_in_place_rerun_the_stages_that_run_it(tmp_path):
    """A local target directory is an input of the stages that run the target: new weights under the same
    path make them stale."""
    import dataclasses

    from eyas.pipeline.table import _target_files

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"weights one")
    run, record = tmp_path / "run", tmp_path / "record.jsonl"
    stage = dataclasses.replace(fake_stage("a", "a", ["--record", str(record)], config=["target"]),
                                external=_target_files)
    cfg = load_config("tiny", [f"target.model={model}"])
    assert _target_files(cfg) == [str(model)] and _target_files(load_config("tiny")) == []
    run_pipeline(cfg, run, QUIET, (stage,))
    run_pipeline(cfg, run, QUIET, (stage,))
    assert counts(record) == {"a": 1}

    (model / "model.safetensors").write_bytes(b"weights two, same path")
    run_pipeline(cfg, run, QUIET, (stage,))
    assert counts(record) == {"a": 2}
