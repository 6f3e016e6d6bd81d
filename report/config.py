"""Options of ``vlmshard report``: one definition each (flag, YAML key, type, help)."""

from __future__ import annotations

from dataclasses import dataclass

from vlmshard.config import ConfigError, option


@dataclass(kw_only=True)
class ReportConfig:
    """Options of ``vlmshard report``."""

    plan_dirs: list[str] = option(factory=list, positional=True, metavar="PLAN_DIR",
                                  help="plan folder(s), one column each")
    train_log: str | None = option(None, metavar="JSONL",
                                   help="train_log.jsonl of a run on the first plan's shards")
    profile: str | None = option(
        None, metavar="DIR", help="with --train-log: replay the run with this `vlmshard train "
                                  "profile` folder's measured layer times (and predict seconds)",
        default_text="the analytic FLOPs of the run's model (shares of time only)")
    html: str | None = option(None, metavar="PATH",
                              help="write a self-contained HTML report with plots")
    out_json: str | None = option(None, metavar="PATH",
                                  help="write the report as JSON to PATH (--json prints it "
                                       "instead of the table)")

    def __post_init__(self) -> None:
        if not self.plan_dirs:
            raise ConfigError("give at least one PLAN_DIR")
        if self.profile and not self.train_log:
            raise ConfigError("--profile replays a training run: give its --train-log too")
