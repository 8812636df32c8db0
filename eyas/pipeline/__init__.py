"""`eyas run`: the stage table (table.py), the runner that runs it in a run directory (runner.py) and the run
report (report.py). The run directory's paths are named in eyas.layout."""

from eyas.gpu.devices import parse_gpus
from eyas.pipeline.report import write_report
from eyas.pipeline.runner import RunOptions, Runner, StageFailed, check_inputs_outside, run_pipeline
from eyas.pipeline.table import STAGES, Cmd, Ctx, Stage, config_changes, config_values, fingerprint_parts, manifest

__all__ = ["STAGES", "Cmd", "Ctx", "RunOptions", "Runner", "Stage", "StageFailed", "check_inputs_outside",
           "config_changes", "config_values", "fingerprint_parts", "manifest", "parse_gpus", "run_pipeline",
           "write_report"]
